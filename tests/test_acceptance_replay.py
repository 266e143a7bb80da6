"""experiments.acceptance_replay: the training eval's teacher-forced drafts are the decode loop's drafts. On the toy
target's greedy rows, replaying the loop's walk over the EAGLE-3 eval's per-length agreements, or a draft model's
(a TargetEmbeddingDraft made from the target's first layers, with a draft vocabulary), accepts exactly what the loop
accepted at every step (a train/serve mismatch would show as steps that differ), and the check sees a planted one:
agreements read one committed length off."""
import numpy as np
import pytest

import specjax
from specjax.drafters import draft_model
from experiments import acceptance_replay
from experiments.prompts import humaneval_prompts


@pytest.fixture(scope="module")
def target():
    return specjax.load_model("stdlib-target")


def test_the_eval_drafts_what_the_loop_drafts_and_a_shifted_eval_is_caught(target):
    prompts = humaneval_prompts(4)
    row = acceptance_replay.measure(target, "eagle3", "stdlib-target-eagle3", prompts, 0.0, k=4,
                                    max_new_tokens=48, batch_size=4)
    assert row["exact"] == 4
    assert row["walk_steps"] > 20 and row["walk_mismatches"] == 0
    np.testing.assert_allclose(row["walk_accept"], row["loop_accept"], atol=0.03)   # steps near a row's end
    assert 0 < row["loop_accept"][0] < 1

    good, _ = acceptance_replay.training_eval("eagle3", target, "stdlib-target-eagle3", 4)

    def shifted(rows):                     # a planted train/serve mismatch: each length reads its neighbour's drafts
        ca = good(rows)
        return ca._replace(agree=np.roll(ca.agree, 1, axis=2))
    bad = acceptance_replay.measure(target, "eagle3", "stdlib-target-eagle3", prompts, 0.0, k=4,
                                    max_new_tokens=48, batch_size=4, agreement_fn=shifted)
    assert bad["walk_mismatches"] > bad["walk_steps"] // 4


def test_the_sampled_prediction_tracks_the_loop(target):
    """At T = 1 the eval predicts the loop's per-draft acceptance from 1 - TV(p, q) along each chain."""
    row = acceptance_replay.measure(target, "eagle3", "stdlib-target-eagle3", humaneval_prompts(8), 1.0, k=3,
                                    max_new_tokens=64, batch_size=8)
    np.testing.assert_allclose(row["walk_accept"], row["loop_accept"], atol=0.08)


def test_a_draft_model_reading_the_target_embedding(target, tmp_path):
    """train.draft --init_layers' artifact: the target's first 3 of 4 layers through a draft vocabulary of 4 in 5 of
    its tokens (drafts both accepted and rejected, some tokens out of its reach). Its eval (draft_agreements) replays
    the loop's walk exactly and sees the planted shift; it reads tokens only, so no real-feature counterfactual."""
    V = target.config.vocab_size
    ids = np.flatnonzero(np.arange(V) % 5 != 3)
    draft = draft_model.init_from_target(specjax.load_model("stdlib-target", weight_format="float32"), 3,
                                         d2t=(ids - np.arange(len(ids))).astype(np.int64))
    draft_model.save(tmp_path, draft, target, "# test draft\n")
    prompts, path = humaneval_prompts(4), str(tmp_path)
    evaluation = acceptance_replay.training_eval("draft_model", target, path, 4)
    row = acceptance_replay.measure(target, "draft_model", path, prompts, 0.0, k=4, max_new_tokens=48, batch_size=4,
                                    evaluation=evaluation)
    assert row["exact"] == 4
    assert row["walk_steps"] > 20 and row["walk_mismatches"] == 0
    assert 0 < row["loop_accept"][0] < 1 and row["loop_accept"][1] > 0
    assert row["walk_real_feature_draft1_next"] is None and 0 <= row["walk_draft2_given_draft1"] <= 1

    def shifted(rows):
        ca = evaluation[0](rows)
        return ca._replace(agree=np.roll(ca.agree, 1, axis=2))
    bad = acceptance_replay.measure(target, "draft_model", path, prompts, 0.0, k=4, max_new_tokens=48, batch_size=4,
                                    evaluation=evaluation, agreement_fn=shifted)
    assert bad["walk_mismatches"] > bad["walk_steps"] // 4
