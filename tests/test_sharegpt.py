"""The ShareGPT reader on a file cut mid-item (as the wheel's is), and the held-out split."""
import json

from train import sharegpt


def _item(i, turns):
    return {"id": f"conv{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_reads_complete_items_of_a_cut_file(tmp_path):
    items = [_item(0, [("human", "hi"), ("gpt", "hello")]), _item(1, [("gpt", "no user turn")]),
             _item(2, [("human", "a"), ("gpt", ""), ("tool", "x"), ("human", "b")]), _item(3, [("human", "last")])]
    text = json.dumps(items, indent=1)
    path = tmp_path / "sg.json"
    path.write_text(text[:text.index('"last"') + 3])                  # cut inside the last item
    convs = sharegpt.read_conversations(str(path))
    assert [c.id for c in convs] == ["conv0", "conv2"]                 # conv1: no user turn; conv3: cut off
    assert convs[1].messages == ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    path.write_text(json.dumps(items))                                 # a whole file reads to its end
    assert [c.id for c in sharegpt.read_conversations(str(path))] == ["conv0", "conv2", "conv3"]


def test_split_is_deterministic_and_disjoint():
    convs = [sharegpt.Conversation(f"id{i}", ({"role": "user", "content": str(i)},)) for i in range(4000)]
    train, held = sharegpt.split(convs)
    again_train, again_held = sharegpt.split(list(reversed(convs)))
    assert {c.id for c in held} == {c.id for c in again_held} and {c.id for c in train} == {c.id for c in again_train}
    assert not {c.id for c in train} & {c.id for c in held}
    assert 0.03 < len(held) / len(convs) < 0.07                        # HELDOUT_FRACTION = 0.05
    chats = sharegpt.first_turn_chats(held, 5)
    assert len(chats) == 5 and all(c[0]["role"] == "user" for c in chats)
