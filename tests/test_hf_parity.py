"""Logit parity against transformers for Llama (GQA, Llama-3 RoPE scaling), Qwen2 (qkv bias, tied) and Mistral
(sliding window), through our Hugging Face checkpoint loader/saver: prefill, cached decode (single tokens, chunks,
ragged rollback), save -> transformers round trips, bf16 and sharded checkpoints."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from specjax.cache import KVCache  # noqa: E402
from specjax.models import forward, full_logits, load_pretrained, save_pretrained  # noqa: E402
from hf_models import CASES, SW, VOCAB, hf_model  # noqa: E402

B, T = 3, 20
TOL = 1e-4


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def _tokens(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(B, T), dtype=np.int32)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kind = request.param
    model = hf_model(kind)
    d = tmp_path_factory.mktemp(kind)
    model.save_pretrained(d)
    tokens = _tokens()
    params, cfg, tok = load_pretrained(d)
    return dict(kind=kind, model=model, dir=d, tokens=tokens, ref=_hf_logits(model, tokens), params=params,
                cfg=cfg, tok=tok)


_jit_forward = jax.jit(forward, static_argnums=(1,))
_jit_full = jax.jit(full_logits, static_argnums=(1,))


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def test_config_and_layout(case):
    cfg, params, hf = case["cfg"], case["params"], case["model"].config
    assert cfg.family == hf.model_type
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert case["tok"] is None
    assert ("lm_head" in params) == (not hf.tie_word_embeddings)
    assert params["layers"][0]["wq"].shape == (64, 64) and params["layers"][0]["wk"].shape == (64, 32)
    assert params["layers"][0]["w_down"].shape == (96, 64)
    if case["kind"] == "qwen2_tied":
        assert cfg.attention_bias and "bq" in params["layers"][0]
    if case["kind"] == "mistral_swa":
        assert cfg.sliding_window == SW
    if case["kind"] == "llama3_rope":
        assert cfg.rope_theta == 500000.0 and cfg.rope_scaling_dict["rope_type"] == "llama3"


def test_prefill_parity(case):
    got = _jit_full(case["params"], case["cfg"], jnp.asarray(case["tokens"]))
    assert got.shape == (B, T, VOCAB)
    # Logits must not be near-flat, or the tolerance would prove little.
    assert float(np.std(case["ref"])) > 0.5
    assert _max_err(got, case["ref"]) < TOL


def test_sliding_window_matters(tmp_path):
    """The Mistral case's window (8 < T = 20) really changes the logits, so its parity checks exercise it."""
    import dataclasses
    model = hf_model("mistral_swa")
    model.save_pretrained(tmp_path)
    tokens = _tokens()
    ref = _hf_logits(model, tokens)
    params, cfg, _ = load_pretrained(tmp_path)
    assert cfg.sliding_window == SW
    no_sw = dataclasses.replace(cfg, sliding_window=None)
    got = _jit_full(params, no_sw, jnp.asarray(tokens))
    assert _max_err(got[:, :SW], ref[:, :SW]) < TOL               # identical inside the window
    assert _max_err(got, ref) > 1e-2                               # differs past it


def test_cached_decode_parity(case):
    """Prefill, roll rows back to ragged lengths, then feed single tokens and a T=3 chunk per step; every step's
    logits must equal transformers' full-sequence logits at those positions."""
    params, cfg, tokens, ref = case["params"], case["cfg"], case["tokens"], case["ref"]
    cache = KVCache.init(cfg.num_layers, B, T + 4, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    prefill = 9
    out = _jit_forward(params, cfg, jnp.asarray(tokens[:, :prefill]), cache)
    assert _max_err(out.logits, ref[:, :prefill]) < TOL
    lengths = np.array([prefill, prefill - 2, prefill - 1], np.int32)      # ragged rollback
    cache = out.cache.replace(lengths=jnp.asarray(lengths))
    for step in (1, 1, 3, 1, 3, 1):
        if lengths.max() + step > T:
            break
        chunk = np.stack([tokens[b, lengths[b]:lengths[b] + step] for b in range(B)])
        out = _jit_forward(params, cfg, jnp.asarray(chunk), cache)
        want = np.stack([ref[b, lengths[b]:lengths[b] + step] for b in range(B)])
        assert _max_err(out.logits, want) < TOL, (case["kind"], step, lengths)
        lengths = lengths + step
        cache = out.cache.replace(lengths=jnp.asarray(lengths))
    assert lengths.min() > SW                                              # decode went past the window


def test_round_trip_through_transformers(case, tmp_path):
    save_pretrained(case["params"], case["cfg"], tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors") and not os.path.exists(tmp_path / "tokenizer.json")
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["torch_dtype"] == "float32"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    orig = case["model"].state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, orig[k]), k
    assert _max_err(_hf_logits(back, case["tokens"]), case["ref"]) < 1e-5
    params2, cfg2, _ = load_pretrained(tmp_path)
    assert cfg2 == case["cfg"]
    for a, b in zip(jax.tree_util.tree_leaves(params2), jax.tree_util.tree_leaves(case["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_save_load(case, tmp_path):
    save_pretrained(case["params"], case["cfg"], tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    p32, cfg, _ = load_pretrained(tmp_path)                               # upcast on load
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                                     case["params"])
    for a, b in zip(jax.tree_util.tree_leaves(p32), jax.tree_util.tree_leaves(rounded)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), b)
    p16, _, _ = load_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(p16))
    # transformers reads the bf16 file to the same weights; its float32 logits match ours on them.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    got = _jit_full(p32, cfg, jnp.asarray(case["tokens"]))
    assert _max_err(got, _hf_logits(hf, case["tokens"])) < TOL
    # Also a bf16 checkpoint written by transformers itself.
    d2 = tmp_path / "hf_bf16"
    copy.deepcopy(case["model"]).to(torch.bfloat16).save_pretrained(d2)   # .to() is in place: copy first
    p2, _, _ = load_pretrained(d2)
    for a, b in zip(jax.tree_util.tree_leaves(p2), jax.tree_util.tree_leaves(rounded)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_sharded_checkpoints(case, tmp_path):
    # Written by transformers.
    d1 = tmp_path / "hf_sharded"
    case["model"].save_pretrained(d1, max_shard_size="40KB")
    assert os.path.isfile(d1 / "model.safetensors.index.json")
    assert len([f for f in os.listdir(d1) if f.endswith(".safetensors")]) > 1
    p1, cfg1, _ = load_pretrained(d1)
    assert _max_err(_jit_full(p1, cfg1, jnp.asarray(case["tokens"])), case["ref"]) < TOL
    # Written by us, read by transformers and by us.
    d2 = tmp_path / "ours_sharded"
    save_pretrained(case["params"], case["cfg"], d2, max_shard_bytes=40_000)
    shards = sorted(f for f in os.listdir(d2) if f.endswith(".safetensors"))
    assert len(shards) > 1 and not os.path.exists(d2 / "model.safetensors")
    index = json.loads((d2 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    back = transformers.AutoModelForCausalLM.from_pretrained(d2, attn_implementation="eager").eval()
    assert _max_err(_hf_logits(back, case["tokens"]), case["ref"]) < 1e-5
    p2, cfg2, _ = load_pretrained(d2)
    assert _max_err(_jit_full(p2, cfg2, jnp.asarray(case["tokens"])), case["ref"]) < TOL


def test_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(100)} | {"<unk>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model = hf_model("llama_gqa")
    model.save_pretrained(tmp_path / "a")
    tok.save(str(tmp_path / "a" / "tokenizer.json"))
    params, cfg, tok2 = load_pretrained(tmp_path / "a")
    assert tok2 is not None and tok2.encode("w3 w7 zz").ids == [3, 7, 100]
    save_pretrained(params, cfg, tmp_path / "b", tokenizer=tok2)
    _, _, tok3 = load_pretrained(tmp_path / "b")
    assert tok3.encode("w5 w99").ids == [5, 99]
