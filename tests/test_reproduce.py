"""experiments/reproduce.py end to end on tiny random checkpoints written in the published layouts: a Hugging Face
Llama target (with a word-level tokenizer, so JSONL text prompts encode), EAGLE-1 and EAGLE-3 checkpoints in the
EAGLE repositories' layouts and Medusa heads in FasterDecoding/Medusa's. Each run goes through the script's absl
flags and main(), with the method inferred from the drafter's directory, batch 2 and 8 new tokens, and must print
and write alpha, tau, the speedup and exact=True (greedy). Also: clear errors for bad JSONL lines, and the paper
numbers matched by method and target."""
import json
import os

import jax
import numpy as np
import pytest
from absl import flags

from experiments import reproduce
from specjax.drafters import eagle, medusa
from specjax.models.hf_io import save_pretrained
from drafter_weights import informative_eagle
from layouts import eagle_published_state_dict, write_checkpoint, write_medusa_repo_layout
from tiny import tiny_model

FLAGS = flags.FLAGS
VOCAB = 61


def word_tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary: "w1 w2 ..." -> [1, 2, ...], anything else -> 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def random_eagle3(target, draft_vocab=40, seed=0):
    rng = np.random.default_rng(seed)
    cfg = eagle.eagle_config(target, "eagle3", target_layers=(0, 0, 0), draft_vocab_size=draft_vocab)
    shapes = jax.eval_shape(lambda: eagle.init_params(jax.random.PRNGKey(0), cfg))
    params = jax.tree_util.tree_map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32), shapes)
    d2t = np.sort(rng.choice(target.config.vocab_size, draft_vocab, replace=False)) - np.arange(draft_vocab)
    return eagle.EagleWeights(cfg, params, d2t, "random-eagle3")


def random_medusa(target, num_heads=3, num_layers=1, seed=0):
    rng = np.random.default_rng(seed)
    H, V = target.config.hidden_size, target.config.vocab_size
    normal = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)
    return medusa.MedusaHeads(num_heads, num_layers, "per_head", {"w": normal(num_heads, num_layers, H, H),
                                                                  "b": normal(num_heads, num_layers, H),
                                                                  "proj": normal(num_heads, H, V)}, "random")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce")
    target = tiny_model(0, vocab=VOCAB, layers=1)
    paths = {"target": str(root / "tiny-Vicuna-7B-target")}     # the paper's target name inside the path
    save_pretrained(target.params, target.config, paths["target"], tokenizer=word_tokenizer())
    # EAGLE-1: informative (it accepts drafts); EAGLE-3 and Medusa: random numpy weights (built without compiling)
    for kind, layout, weights in (("eagle", "eagle1", informative_eagle(target, "eagle")),
                                  ("eagle3", "eagle3", random_eagle3(target))):
        sd, hf = eagle_published_state_dict(weights, target, layout)
        paths[kind] = str(root / layout)
        write_checkpoint(paths[kind], sd, hf)
    paths["medusa"] = str(root / "medusa")
    write_medusa_repo_layout(paths["medusa"], random_medusa(target), target)
    paths["prompts"] = str(root / "prompts.jsonl")
    with open(paths["prompts"], "w") as f:
        f.write(json.dumps({"prompt": "w3 w4 w5 w3 w4 w5 w3 w4"}) + "\n\n")        # a blank line is skipped
        f.write(json.dumps({"turns": ["w7 w8 w9 w10 w7 w8 w9", "a second turn"], "category": "x"}) + "\n")
        f.write(json.dumps({"prompt": "w11 w12 w11 w12 w11"}) + "\n")
    paths["papers"] = str(root / "paper_numbers.csv")
    with open(paths["papers"], "w") as f:
        f.write("# a comment line\npaper,target,drafter_or_method,dataset,temperature,k_or_tree,alpha,c,tau,speedup,"
                "hardware,src,method\n"
                "EAGLE,Vicuna-7B,EAGLE,MT-bench,0,tree,,,3.94,2.90,,S4,eagle\n"
                "EAGLE,Vicuna-13B,EAGLE,MT-bench,0,tree,,,3.98,3.07,,S4,eagle\n"
                "EAGLE-3,LLaMA3.1-8B-Instruct,EAGLE-3,MT-bench,0,dyn,,,6.13,4.40,,S6,eagle3\n")
    return paths


def run(capsys, tmp_path, **flag_values):
    """reproduce.main through its flags -> (printed text, the row written)."""
    FLAGS.unparse_flags()
    argv = ["reproduce"] + [f"--{k}={v}" for k, v in flag_values.items()] + [f"--out={tmp_path}/row"]
    FLAGS(argv)
    try:
        reproduce.main([])
    finally:
        FLAGS.unparse_flags()
    with open(tmp_path / "row.json") as f:
        rows = json.load(f)["rows"]
    assert os.path.isfile(tmp_path / "row.csv") and len(rows) == 1
    return capsys.readouterr().out, rows[0]


CASES = [   # (drafter, method inferred from its directory, drafting flags)
    ("eagle", "eagle", dict(k=3)),
    ("eagle3", "eagle3", dict(k=2)),
    ("medusa", "medusa", dict(k=2)),
]


@pytest.mark.parametrize("drafter,method,shape", CASES, ids=[c[0] for c in CASES])
def test_published_layouts_reproduce(capsys, tmp_path, ckpts, drafter, method, shape):
    out, row = run(capsys, tmp_path, target=ckpts["target"], drafter=ckpts[drafter], prompt_set=ckpts["prompts"],
                   num_prompts=2, batch_size=2, max_new_tokens=8, predict=False, paper_numbers=ckpts["papers"],
                   **shape)
    assert f"method {method} from {ckpts[drafter]} (from the drafter's directory)" in out
    for word in ("alpha", "tau", "tokens/s", "speedup", "exact     True"):
        assert word in out, out
    assert "wrote " in out and str(tmp_path / "row.csv") in out
    assert row["method"] == method and row["exact"] is True and row["identical_outputs"] == 2
    assert 0 <= row["alpha"] <= 1 and row["tau"] >= 1 and row["speedup"] > 0
    assert row["tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
    assert row["num_prompts"] == 2 and row["batch_size"] == 2 and row["max_new_tokens"] == 8
    if method == "eagle":      # the paper's row for this method and target ("Vicuna-7B" is in the target's path)
        assert row["alpha"] > 0 and row["tau"] > 1, row        # the informative drafter gets drafts accepted
        assert "method eagle and target Vicuna-7B" in out and "[row 0] EAGLE: Vicuna-7B + EAGLE" in out
        assert row["paper_tau"] == "3.94" and row["paper_speedup"] == "2.90" and row["paper_row"] == 0
        assert "Vicuna-13B" not in out
    if method == "eagle3":     # a row for the method, none for this target: said, and the other targets shown
        assert "no row for this target" in out and row["paper_target"] == "LLaMA3.1-8B-Instruct"
    if method == "medusa":
        assert "nothing in" in out and "no paper row for method medusa" in out and row["paper_row"] is None


@pytest.mark.slow
def test_dynamic_tree_short_last_batch_and_prediction(capsys, tmp_path, ckpts):
    """An EAGLE-2-style dynamic tree, 3 prompts at batch 2 (a last batch of 1), the predicted speedup, and no
    paper numbers file."""
    out, row = run(capsys, tmp_path, target=ckpts["target"], drafter=ckpts["eagle"], num_steps=2, topk=2,
                   num_draft_tokens=4, prompt_set=ckpts["prompts"], num_prompts=3, batch_size=2, max_new_tokens=8,
                   paper_numbers=str(tmp_path / "missing.csv"))
    assert row["exact"] is True and row["identical_outputs"] == 3 and row["num_prompts"] == 3
    assert row["tree"] == "dyn2x2" and row["k"] == 3 and "dynamic tree 2x2" in out
    assert row["predicted"] > 0 and row["c"] > 0 and "predicted" in out
    assert "no paper numbers" in out and "missing.csv not found" in out


BAD_LINES = [
    ('{"prompt": "w1 w2"', "line 2: not valid JSON"),
    ('["w1", "w2"]', "line 2: expected a JSON object"),
    ('{"text": "w1 w2"}', "line 2: no \"prompt\" or \"turns\" key"),
    ('{"prompt": 5}', "line 2: \"prompt\" must be a non-empty string"),
    ('{"turns": []}', "line 2: \"turns\" must be a non-empty list"),
    ('{"turns": [{"role": "user"}]}', "line 2: the first turn must be a non-empty string"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES, ids=[m.split(": ")[1][:20] for _, m in BAD_LINES])
def test_bad_jsonl_names_the_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "w1 w2 w3"}) + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + " " + message.replace("[", r"\[")):
        reproduce.load_jsonl_prompts(str(path))


def test_bad_jsonl_through_main(tmp_path, ckpts):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "w1 w2"}\n{"prompt": "w3"}\n{"question": "w4"}\n')
    FLAGS.unparse_flags()
    FLAGS(["reproduce", f"--target={ckpts['target']}", f"--drafter={ckpts['eagle']}", "--k=2",
           f"--prompt_set={path}"])
    try:
        with pytest.raises(ValueError, match=r"bad\.jsonl line 3: no \"prompt\" or \"turns\" key "
                                             r"\(keys: \['question'\]\)"):
            reproduce.main([])
    finally:
        FLAGS.unparse_flags()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        reproduce.load_jsonl_prompts(str(empty))


def test_method_inference(ckpts):
    target = ckpts["target"]
    assert reproduce.resolve_drafter(ckpts["eagle"], None, target) == ("eagle", ckpts["eagle"])
    assert reproduce.resolve_drafter(ckpts["eagle3"], None, target) == ("eagle3", ckpts["eagle3"])
    assert reproduce.resolve_drafter(ckpts["medusa"], None, target) == ("medusa", ckpts["medusa"])
    assert reproduce.resolve_drafter(target, None, "stdlib-target") == ("draft_model", target)   # a model
    assert reproduce.resolve_drafter(None, "ngram", target) == ("ngram", None)
    assert reproduce.resolve_drafter(ckpts["eagle"], "eagle3", target) == ("eagle3", ckpts["eagle"])  # as asked
    with pytest.raises(ValueError, match="pass --method"):
        reproduce.resolve_drafter(None, None, target)


def test_method_inference_of_shipped_drafters():
    from specjax.checkpoints import shipped_dir
    if shipped_dir() is None or not os.path.isdir(os.path.join(shipped_dir(), "stdlib-target-medusa2")):
        pytest.skip("no shipped checkpoints")
    assert reproduce.resolve_drafter("stdlib-target-eagle3", None, "stdlib-target")[0] == "eagle3"
    assert reproduce.resolve_drafter("stdlib-draft", None, "stdlib-target")[0] == "draft_model"
    # Medusa-2's heads ship inside their own target: drafting from the target's directory means those heads
    m2 = os.path.join(shipped_dir(), "stdlib-target-medusa2")
    assert reproduce.resolve_drafter("stdlib-target-medusa2", None, m2) == ("medusa", os.path.join(m2, "medusa_heads"))
    assert reproduce.resolve_drafter("stdlib-target-mtp4", "mtp_heads", "stdlib-target")[0] == "mtp_heads"


def test_paper_row_selection(ckpts):
    rows = reproduce.read_paper_numbers(ckpts["papers"])
    assert [r["_row"] for r in rows] == [0, 1, 2]                   # comment lines are not rows
    match = lambda method, paper_row=None, target="/m/vicuna-13b-v1.3": reproduce.match_paper(
        rows, method, [target], "mt_bench.jsonl", 0.0, paper_row, "chain")
    found, how = match("eagle")
    assert [r["target"] for r in found] == ["Vicuna-13B"] and "target Vicuna-13B" in how
    found, how = match("eagle", target="/m/other")                  # no row for this target: the method's rows
    assert [r["_row"] for r in found] == [0, 1] and "no row for this target" in how
    assert [r["_row"] for r in match("eagle", "2")[0]] == [2]       # an index picks that row, whatever the method
    assert [r["_row"] for r in match("eagle", "target=7B", "/m/other")[0]] == [0]
    found, how = match("eagle", "EAGLE-2")                          # a bare word is the paper: EAGLE, not EAGLE-2
    assert found == [] and "no paper row for method eagle, EAGLE-2" in how
    assert "unknown columns ['bogus']" in match("eagle", "bogus=1")[1]
    assert "rows 0..2" in match("eagle", "7")[1]
    assert match("draft_model")[0] == []
