"""Bad checkpoint directories fail with an error that names the file and the problem (no torch needed)."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import ModelConfig, init_params, load_pretrained, save_pretrained
from specjax.models.hf_io import SafetensorsFile

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="llama")


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    save_pretrained(init_params(CFG, jax.random.PRNGKey(0)), CFG, d)
    return d


@pytest.fixture
def ckpt(good_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(good_dir, d)
    return d


def _tensors(d):
    f = SafetensorsFile(str(d / "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.keys()}


def _write(d, tensors):
    from safetensors.numpy import save_file
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d, **kw):
    p = d / "config.json"
    hf = json.loads(p.read_text())
    hf.update(kw)
    p.write_text(json.dumps(hf))


def test_good_checkpoint_loads(ckpt):
    params, cfg, tok = load_pretrained(ckpt)
    assert cfg == CFG and tok is None and params["layers"][1]["wk"].shape == (32, 16)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found") as e:
        load_pretrained(tmp_path / "nope")
    assert "nope" in str(e.value)


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_pretrained(ckpt)


def test_missing_weights(ckpt):
    os.remove(ckpt / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights") as e:
        load_pretrained(ckpt)
    assert "model.safetensors" in str(e.value) and str(ckpt) in str(e.value)


def test_only_pytorch_bin_weights(ckpt):
    os.remove(ckpt / "model.safetensors")
    (ckpt / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        load_pretrained(ckpt)


def test_truncated_safetensors(ckpt):
    p = ckpt / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated") as e:
        load_pretrained(ckpt)
    assert "model.safetensors" in str(e.value)


def test_truncated_inside_header(ckpt):
    p = ckpt / "model.safetensors"
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        load_pretrained(ckpt)


def test_garbage_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        load_pretrained(ckpt)


def test_missing_tensor_keys(ckpt):
    t = _tensors(ckpt)
    for k in ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"]:
        del t[k]
    _write(ckpt, t)
    with pytest.raises(ValueError, match="missing 3 tensor") as e:
        load_pretrained(ckpt)
    for k in ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"]:
        assert k in str(e.value)


def test_untied_config_without_lm_head(ckpt):
    t = _tensors(ckpt)
    del t["lm_head.weight"]
    _write(ckpt, t)
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_pretrained(ckpt)
    _edit_config(ckpt, tie_word_embeddings=True)                    # declared tied: fine
    params, cfg, _ = load_pretrained(ckpt)
    assert cfg.tie_word_embeddings and "lm_head" not in params


def test_shape_mismatch(ckpt):
    _edit_config(ckpt, intermediate_size=40)
    with pytest.raises(ValueError, match="shape mismatch") as e:
        load_pretrained(ckpt)
    msg = str(e.value)
    assert "mlp.gate_proj.weight" in msg and "[48, 32]" in msg and "[40, 32]" in msg


def test_unexpected_tensor(ckpt):
    t = _tensors(ckpt)
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    _write(ckpt, t)
    with pytest.raises(ValueError, match="does not know how to use") as e:
        load_pretrained(ckpt)
    assert "o_proj.bias" in str(e.value)


@pytest.mark.parametrize("arch,model_type", [(["GPT2LMHeadModel"], "gpt2"), ([], "phi3")])
def test_unknown_architecture(ckpt, arch, model_type):
    _edit_config(ckpt, architectures=arch, model_type=model_type)
    with pytest.raises(ValueError, match="unknown architecture") as e:
        load_pretrained(ckpt)
    assert "config.json" in str(e.value)


def test_unsupported_activation(ckpt):
    _edit_config(ckpt, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        load_pretrained(ckpt)


def _word_tokenizer(n):
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)}, unk_token="t0"))


def test_tokenizer_vocab_too_large(ckpt):
    pytest.importorskip("tokenizers")
    _word_tokenizer(CFG.vocab_size + 10).save(str(ckpt / "tokenizer.json"))
    with pytest.raises(ValueError, match="vocab size mismatch") as e:
        load_pretrained(ckpt)
    assert f"{CFG.vocab_size + 10} tokens" in str(e.value) and "tokenizer.json" in str(e.value)


def test_tokenizer_smaller_than_vocab_is_fine(ckpt):
    pytest.importorskip("tokenizers")
    _word_tokenizer(CFG.vocab_size - 4).save(str(ckpt / "tokenizer.json"))
    _, _, tok = load_pretrained(ckpt)
    assert tok.get_vocab_size() == CFG.vocab_size - 4


def test_corrupt_tokenizer(ckpt):
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_pretrained(ckpt)


@pytest.fixture
def sharded(tmp_path):
    d = tmp_path / "sharded"
    save_pretrained(init_params(CFG, jax.random.PRNGKey(0)), CFG, d, max_shard_bytes=8_000, dtype="bfloat16")
    return d


def test_sharded_loads(sharded, good_dir):
    shards = [f for f in os.listdir(sharded) if f.startswith("model-")]
    assert len(shards) > 2
    params, cfg, _ = load_pretrained(sharded)
    ref, _, _ = load_pretrained(good_dir)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-3)


def test_index_names_missing_shard(sharded):
    victim = sorted(f for f in os.listdir(sharded) if f.startswith("model-"))[1]
    os.remove(sharded / victim)
    with pytest.raises(FileNotFoundError, match="do not exist") as e:
        load_pretrained(sharded)
    assert victim in str(e.value) and "model.safetensors.index.json" in str(e.value)


def test_index_maps_tensor_to_wrong_shard(sharded):
    p = sharded / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][name] = shards[-1]
    p.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="does not contain it") as e:
        load_pretrained(sharded)
    assert name in str(e.value)


def test_corrupt_index(sharded):
    (sharded / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="corrupt index file"):
        load_pretrained(sharded)


def test_truncated_shard(sharded):
    victim = sorted(f for f in os.listdir(sharded) if f.startswith("model-"))[0]
    p = sharded / victim
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated") as e:
        load_pretrained(sharded)
    assert victim in str(e.value)


def test_resave_switches_layout(sharded):
    """Saving unsharded over a sharded directory must not leave the old index behind."""
    params, cfg, _ = load_pretrained(sharded)
    save_pretrained(params, cfg, sharded)
    assert sorted(os.listdir(sharded)) == ["config.json", "model.safetensors"]
    load_pretrained(sharded)


def test_save_rejects_mismatched_params(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="tie_word_embeddings=False but params have no 'lm_head'"):
        save_pretrained({k: v for k, v in params.items() if k != "lm_head"}, CFG, tmp_path)
    with pytest.raises(ValueError, match="unsupported save dtype"):
        save_pretrained(params, CFG, tmp_path, dtype="int8")
    bad = dict(params, embed=jnp.zeros((CFG.vocab_size, 16)))
    with pytest.raises(ValueError, match="embed_tokens"):
        save_pretrained(bad, CFG, tmp_path)


def test_a_drafter_artifact_is_not_a_model(tmp_path):
    """Shipped drafter artifacts are listed apart from models, and loading one as a model says what it is."""
    import specjax
    assert "stdlib-target" in specjax.available_models()
    assert "stdlib-target-eagle" in specjax.available_drafters()
    assert not set(specjax.available_models()) & set(specjax.available_drafters())
    with pytest.raises(ValueError, match="'stdlib-target-eagle' is a 'eagle' drafter artifact, not a model"):
        specjax.load_model("stdlib-target-eagle")
