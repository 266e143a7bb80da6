"""The accelerator session's drafters part (pallas_kernels/bench/accelerator_session.sh drafters) on this CPU, so that
the script cannot rot while no GPU is at hand: SMOKE=1 runs the GPU's path end to end with tiny sizes (self-distilled
rows from the cached prompt token ids, EAGLE-3 trained with bfloat16 arithmetic, the held-out replay at T = 0 and 1,
experiments.speedup at batch 1 and 2, the packed drafter and the timeline), on a 4-layer random target that speaks
SmolLM2's tokenizer and chat template (SmolLM2's own 30 layers would spend the minutes compiling); a second call
finds every stage finished in the stash and only repacks."""
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile

import jax
import pytest

import specjax
from experiments import prompts
from specjax.models.hf_io import save_pretrained
from specjax.models.llama import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pallas_kernels", "bench", "accelerator_session.sh")
STAGES = ["prompts", "distill", "train_eagle3", "replay", "e2e_new", "e2e_new_batch8"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerator")
    smol = specjax.load_model("smollm2-135m", weight_format="float32")
    cfg = dataclasses.replace(smol.config, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    save_pretrained(init_params(cfg, jax.random.PRNGKey(0)), cfg, tmp / "target", tokenizer=smol.tokenizer,
                    chat_template=smol.chat_template)
    (tmp / "prompts").mkdir()
    for name, chats in (("sharegpt", prompts.sharegpt_chats), ("humaneval_chat", prompts.humaneval_chats)):
        (tmp / "prompts" / f"{name}.json").write_text(json.dumps(chats(2)))

    def call(n):
        env = dict(os.environ, SMOKE="1", GGUF=str(tmp / "target"), PROMPTS=str(tmp / "prompts"), SHIPPED="",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], STASH=str(tmp / "stash"), WORK=str(tmp / f"work{n}"), OUT=str(tmp / f"out{n}"), TAIL="3")
        res = subprocess.run(["bash", SCRIPT, "drafters"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout
    return tmp, call(1), call(2)


def test_every_stage_runs_and_the_timeline_counts_compiling(session):
    tmp, _, _ = session
    timeline = json.loads((tmp / "work1" / "timeline.json").read_text())
    assert [s["stage"] for s in timeline["stages"]] == STAGES
    assert all(s["exit"] == 0 for s in timeline["stages"]), timeline
    assert 0 < timeline["compile_seconds"] < timeline["seconds"]
    assert timeline["stages"][2]["compile_seconds"] > 0                 # the training step's program


def test_the_drafter_comes_back_packed_in_bfloat16_with_its_manifest(session):
    tmp, _, _ = session
    parts = sorted(p for p in os.listdir(tmp / "out1") if p.startswith("drafters.tgz.part_"))
    assert parts and all(os.path.getsize(tmp / "out1" / p) <= 15 * 2 ** 20 for p in parts)
    blob = b"".join((tmp / "out1" / p).read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        names = tar.getnames()
        config = json.load(tar.extractfile("drafters/smollm2-135m-eagle3-gpu/config.json"))
        manifest = tar.extractfile("drafters/smollm2-135m-eagle3-gpu/MANIFEST.md").read().decode()
    assert "drafters/smollm2-135m-eagle3-gpu/model.safetensors" in names, names
    assert config["storage_dtype"] == "bfloat16" and config["specjax_drafter"] == "eagle3"
    assert "--compute_dtype=bfloat16" in manifest and "--chat_rows=" in manifest
    with tarfile.open(tmp / "out1" / "drafters.tgz") as tar:             # the tables and logs, without the drafter
        assert {"./timeline.json", "./replay.json", "./e2e_drafters.json"} <= set(tar.getnames())
        assert not any(n.startswith("./drafters") for n in tar.getnames())


def test_the_replay_and_the_end_to_end_rows_are_exact(session):
    tmp, _, _ = session
    replay = json.loads((tmp / "work1" / "replay.json").read_text())
    rows = replay["rows"]
    assert sorted((r["temperature"], os.path.basename(r["prompt_set"])) for r in rows) == [
        (0.0, "sharegpt.json"), (1.0, "sharegpt.json")]
    for r in rows:
        if r["temperature"] == 0:
            assert r["walk_mismatches"] == 0 and r["exact"] == r["prompts"], r
        assert r["loop_steps"] > 0 and r["tau"] >= 1, r
    e2e = json.loads((tmp / "work1" / "e2e_drafters.json").read_text())
    assert [(r["method"], r["k"]) for r in e2e["rows"]] == [("eagle3", 4), ("eagle3/dyn2x2", 3), ("ngram", 4)], e2e["rows"]
    assert all(r["exact"] == "yes" for r in e2e["rows"]), e2e["rows"]


def test_a_second_call_resumes_from_the_stash(session):
    _, _, second = session
    for stage in STAGES[1:]:
        assert f"== {stage}: finished in an earlier call" in second, second
