"""GGUF reading: files written here with gguf.GGUFWriter, one per tensor type, read back against numpy references
of the block formats; the name and rotary-order mapping against a model's own logits; the tokenizer from the
metadata; clear errors for what is not read."""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specjax import settings
from specjax.models import ModelConfig, full_logits, gguf_io, init_params
from specjax.models.gguf_io import convert_gguf, read_gguf
from specjax.models.model import load_model

RNG = np.random.default_rng(0)
CFG = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
TEXTS = ["def add(a, b):\n    return a + b\n", "Hello world, 12345 tokens!", "  spaces\tand\ttabs\n\n", "héllo ünïcode"]


# ---------------------------------------------------------------------------------- numpy block references

def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:          # blocks of 32: d (f16), 32 x int8
    b = raw.reshape(-1, 34)
    return (_f16(b[:, :2].copy()) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:          # d (f16), 16 bytes: low nibbles are 0..15, high 16..31
    b = raw.reshape(-1, 18)
    q = b[:, 2:]
    vals = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32) - 8
    return (_f16(b[:, :2].copy()) * vals).reshape(-1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:          # d, m (f16), 16 bytes
    b = raw.reshape(-1, 20)
    q = b[:, 4:]
    vals = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32)
    return (_f16(b[:, :2].copy()) * vals + _f16(b[:, 2:4].copy())).reshape(-1)


def _scale_min_k4(j: int, s: np.ndarray):             # 6-bit scale and min j of the 12 packed bytes
    s = s.astype(np.int32)
    if j < 4:
        return s[:, j:j + 1] & 63, s[:, j + 4:j + 5] & 63
    return ((s[:, j + 4:j + 5] & 0xF) | ((s[:, j - 4:j - 3] >> 6) << 4),
            (s[:, j + 4:j + 5] >> 4) | ((s[:, j:j + 1] >> 6) << 4))


def ref_q4_k(raw: np.ndarray) -> np.ndarray:          # super-blocks of 256: d, dmin, scales[12], qs[128]
    b = raw.reshape(-1, 144)
    d, dmin, sc, qs = _f16(b[:, 0:2].copy()), _f16(b[:, 2:4].copy()), b[:, 4:16], b[:, 16:]
    out = []
    for j in range(4):                                 # 64 values per j: low nibbles then high nibbles of 32 bytes
        q = qs[:, 32 * j:32 * j + 32].astype(np.float32)
        for half, vals in ((0, q.astype(np.uint8) & 0xF), (1, q.astype(np.uint8) >> 4)):
            s, m = _scale_min_k4(2 * j + half, sc)
            out.append(d * s.astype(np.float32) * vals - dmin * m.astype(np.float32))
    return np.concatenate(out, axis=1).reshape(-1)


def ref_q5_k(raw: np.ndarray) -> np.ndarray:          # d, dmin, scales[12], qh[32], qs[128]
    b = raw.reshape(-1, 176)
    d, dmin, sc, qh, qs = _f16(b[:, 0:2].copy()), _f16(b[:, 2:4].copy()), b[:, 4:16], b[:, 16:48], b[:, 48:]
    out = []
    for j in range(4):
        q = qs[:, 32 * j:32 * j + 32]
        for half, low in ((0, q & 0xF), (1, q >> 4)):
            high = ((qh >> (2 * j + half)) & 1).astype(np.float32) * 16
            s, m = _scale_min_k4(2 * j + half, sc)
            out.append(d * s.astype(np.float32) * (low.astype(np.float32) + high) - dmin * m.astype(np.float32))
    return np.concatenate(out, axis=1).reshape(-1)


def ref_q6_k(raw: np.ndarray) -> np.ndarray:          # ql[128], qh[64], scales[16] (int8), d
    b = raw.reshape(-1, 210)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:].copy())
    out = np.zeros((b.shape[0], 256), np.float32)
    for n in range(2):                                 # two halves of 128 values
        L, H, S = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], sc[:, 8 * n:8 * n + 8]
        for l in range(32):
            i = l // 16
            q1 = ((L[:, l] & 0xF) | (((H[:, l] >> 0) & 3) << 4)).astype(np.float32) - 32
            q2 = ((L[:, l + 32] & 0xF) | (((H[:, l] >> 2) & 3) << 4)).astype(np.float32) - 32
            q3 = ((L[:, l] >> 4) | (((H[:, l] >> 4) & 3) << 4)).astype(np.float32) - 32
            q4 = ((L[:, l + 32] >> 4) | (((H[:, l] >> 6) & 3) << 4)).astype(np.float32) - 32
            for off, q, s in ((0, q1, S[:, i]), (32, q2, S[:, i + 2]), (64, q3, S[:, i + 4]), (96, q4, S[:, i + 6])):
                out[:, 128 * n + off + l] = d[:, 0] * s * q
    return out.reshape(-1)


def random_k_blocks(n_blocks: int, size: int, f16_at: tuple[int, ...]) -> np.ndarray:
    """Random bytes for n_blocks K-quant super-blocks, with sane float16 values at the given byte offsets."""
    raw = RNG.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in f16_at:
        raw[:, at:at + 2] = RNG.uniform(0.001, 0.01, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


K_FORMATS = {Q.Q4_K: (144, (0, 2), ref_q4_k), Q.Q5_K: (176, (0, 2), ref_q5_k), Q.Q6_K: (210, (208,), ref_q6_k)}
SIMPLE_REFS = {Q.Q8_0: ref_q8_0, Q.Q4_0: ref_q4_0, Q.Q4_1: ref_q4_1}


# ------------------------------------------------------------------------------------------- GGUF writing

def byte_bpe_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CFG.vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog " * 5], trainer)
    return tok


def rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """HF [out, in] Q/K rows -> llama.cpp's order (what its converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, params: dict, cfg: ModelConfig, qtype=Q.F32, tokenizer=None, arch="llama",
               chat_template=None, extra=None, embed_qtype=None):
    """A Llama GGUF file of `params` (specjax layout), every matrix stored as qtype (the embedding as embed_qtype
    when given; norms in F32)."""
    w = GGUFWriter(os.fspath(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list([t for t, _ in vocab])
        w.add_token_types([3 if t in special else 1 for t, _ in vocab])
        w.add_token_merges([" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]])
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def put(name, a, matrix=True, as_type=None):
        a = np.ascontiguousarray(np.asarray(a, np.float32))
        as_type = as_type or qtype
        if matrix and as_type != Q.F32:
            w.add_tensor(name, quantize(a, as_type), raw_dtype=as_type)
        else:
            w.add_tensor(name, a)
    put("token_embd.weight", params["embed"], as_type=embed_qtype)
    put("output_norm.weight", params["final_norm"], False)
    names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
             "w_up": "ffn_up", "w_down": "ffn_down"}
    for i, lp in enumerate(params["layers"]):
        put(f"blk.{i}.attn_norm.weight", lp["attn_norm"], False)
        put(f"blk.{i}.ffn_norm.weight", lp["mlp_norm"], False)
        for key, name in names.items():
            hf = np.asarray(lp[key], np.float32).T                        # [out, in]
            if key in ("wq", "wk"):
                hf = rotary_order(hf, cfg.num_heads if key == "wq" else cfg.num_kv_heads)
            put(f"blk.{i}.{name}.weight", hf)
    for name, a in (extra or {}).items():
        put(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def toy():
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.PRNGKey(0), std=0.2))
    return params


# ----------------------------------------------------------------------------------------------- the tests

def test_f32_file_gives_the_models_own_logits(toy, tmp_path):
    """Names, transposes and the rotary order: a model written to GGUF reads back to the same forward."""
    path = tmp_path / "toy.gguf"
    write_gguf(path, toy, CFG)
    params, cfg, tok, template = read_gguf(path)
    assert cfg == dataclasses.replace(CFG, bos_token_id=None, eos_token_id=None)    # no tokenizer metadata
    assert tok is None and template is None
    ids = jnp.asarray(RNG.integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    want = full_logits(toy, CFG, ids)
    got = full_logits(params, cfg, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_matrices_read_back(toy, tmp_path, qtype):
    """Every matrix close to its float value at the type's precision, and for the plain block formats equal to an
    independent numpy decoding of the stored bytes."""
    path = tmp_path / f"toy-{qtype.name}.gguf"
    write_gguf(path, toy, CFG, qtype)
    params, cfg, _, _ = read_gguf(path)
    tol = {Q.F16: 2e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(qtype, 0.15)
    w = np.asarray(toy["layers"][1]["w_up"])                              # [in, out]
    np.testing.assert_allclose(params["layers"][1]["w_up"], w, atol=tol * np.abs(w).max() * 5)
    if qtype in SIMPLE_REFS:
        raw = quantize(np.ascontiguousarray(w.T), qtype)
        np.testing.assert_array_equal(params["layers"][1]["w_up"], SIMPLE_REFS[qtype](raw).reshape(w.T.shape).T)


@pytest.mark.parametrize("qtype", list(K_FORMATS))
def test_k_quant_blocks_against_numpy_reference(toy, tmp_path, qtype):
    """K-quant super-blocks (gguf cannot quantize to them): random blocks with sane scales, stored as one
    matrix, read back equal to a numpy decoding of ggml's block layout."""
    size, f16_at, ref = K_FORMATS[qtype]
    rows, cols = 4, 512                                                  # 2 super-blocks per row
    raw = random_k_blocks(rows * cols // 256, size, f16_at).reshape(rows, -1)
    path = tmp_path / f"k-{qtype.name}.gguf"
    w = GGUFWriter(os.fspath(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFReader(os.fspath(path)).tensors[0]
    got = gguf_io.dequantized(t, os.fspath(path))
    np.testing.assert_allclose(got, ref(raw.reshape(-1)).reshape(rows, cols), rtol=1e-6, atol=1e-7)


def test_tokenizer_and_chat_template_from_metadata(toy, tmp_path):
    tok = byte_bpe_tokenizer()
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    path = tmp_path / "tok.gguf"
    write_gguf(path, toy, CFG, tokenizer=tok, chat_template=template)
    _, _, got, got_template = read_gguf(path)
    assert got_template == template
    assert got.get_vocab() == tok.get_vocab()
    for text in TEXTS + ["<|im_start|>user\nhi 42<|im_end|>"]:
        assert got.encode(text).ids == tok.encode(text).ids, text
        assert got.decode(got.encode(text).ids, skip_special_tokens=False) == text
    special = {t.content for t in got.get_added_tokens_decoder().values() if t.special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


def test_load_model_converts_once_into_the_cache(toy, tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, os.fspath(tmp_path / "cache"))
    path = tmp_path / "toy.gguf"
    write_gguf(path, toy, CFG, Q.Q8_0, tokenizer=byte_bpe_tokenizer(), chat_template="{{ messages }}")
    model = load_model(path)
    out = convert_gguf(path, os.fspath(tmp_path / "cache"))
    assert os.path.dirname(os.path.dirname(out)) == os.fspath(tmp_path / "cache")
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    again = load_model(path)                                             # found, not converted again
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp
    assert model.config == again.config and model.chat_template == "{{ messages }}"
    assert model.name == "toy"
    assert not [d for d in os.listdir(os.path.dirname(out)) if d.startswith(".converting")]
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), np.asarray(again.params["embed"]))


def test_a_concurrent_conversion_of_the_same_file_is_used(toy, tmp_path, monkeypatch):
    """Two processes (two test workers) converting one file: the one that renames second finds the first's
    directory in place (os.replace cannot replace a non-empty directory) and uses it; any other failure raises."""
    import specjax.models.gguf_io as gguf_io
    path = tmp_path / "toy.gguf"
    write_gguf(path, toy, CFG, Q.Q8_0, tokenizer=byte_bpe_tokenizer())
    first = convert_gguf(path, os.fspath(tmp_path / "first"))
    replace = os.replace

    def racing_replace(src, dst):                # the other converter renames its directory first
        shutil.copytree(first, dst)
        replace(src, dst)

    monkeypatch.setattr(gguf_io.os, "replace", racing_replace)
    out = convert_gguf(path, os.fspath(tmp_path / "cache"))
    assert sorted(os.listdir(out)) == sorted(os.listdir(first))
    assert not [d for d in os.listdir(os.path.dirname(out)) if d.startswith(".converting")]

    def failing_replace(src, dst):               # no other converter: the error stands
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(path, os.fspath(tmp_path / "other"))
    assert not [d for d in os.listdir(tmp_path / "other" / "gguf") if d.startswith(".converting")]


def test_errors_name_the_problem(toy, tmp_path):
    path = tmp_path / "toy.gguf"
    write_gguf(path, toy, CFG)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(cut)
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, toy, CFG, arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2' model; specjax runs"):
        read_gguf(gpt2)
    q2k = tmp_path / "q2k.gguf"
    w = GGUFWriter(os.fspath(q2k), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((1, 84), np.uint8), raw_dtype=Q.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="Q2_K, a type specjax does not read"):
        gguf_io.dequantized(GGUFReader(os.fspath(q2k)).tensors[0], os.fspath(q2k))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf(tmp_path / "missing.gguf")


def test_a_gguf_loaded_model_saves_a_directory_transformers_loads(toy, tmp_path, monkeypatch):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    monkeypatch.setenv(settings.CACHE_ENV, os.fspath(tmp_path / "cache"))
    path = tmp_path / "toy.gguf"
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    write_gguf(path, toy, CFG, Q.Q8_0, tokenizer=byte_bpe_tokenizer(), chat_template=template)
    model = load_model(path)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    again = load_model(out)
    assert again.config == model.config and again.chat_template == template
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "def add(a, b):"}]
    ids = hf_tok.apply_chat_template(chat, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == model.tokenize("<|im_start|>user\ndef add(a, b):<|im_end|>\n")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(model.logits([ids]))[0], want, atol=1e-4)


@pytest.fixture
def q4_1_gguf(toy, tmp_path, monkeypatch):
    """The toy as SmolLM2's file has it: Q4_1 layer matrices, a Q8_0 embedding (converted into a cache of its own)."""
    monkeypatch.setenv(settings.CACHE_ENV, os.fspath(tmp_path / "cache"))
    path = tmp_path / "toy-q4_1.gguf"
    write_gguf(path, toy, CFG, Q.Q4_1, embed_qtype=Q.Q8_0)
    return path


def test_gguf_blocks_compute_exactly_the_float32_model(q4_1_gguf):
    """load_model(..., weight_format="gguf"): the layer matrices stay the file's Q4_1 blocks and the Q8_0 embedding
    serves as the LM head in its blocks (a third of the bytes), and the model's logits, and its greedy tokens plain
    and speculative, are the float32 model's bit for bit."""
    import specjax
    from cpu_kernels import build
    from specjax.models.weights import Q4_1Matrix, Q8_0Matrix
    path = q4_1_gguf
    dense = load_model(path)
    blocks = load_model(path, weight_format="gguf")
    assert isinstance(blocks.params["layers"][1]["w_down"], Q4_1Matrix)
    assert isinstance(blocks.params["layers"][1]["wqkv"], Q4_1Matrix) and "wq" not in blocks.params["layers"][1]
    assert isinstance(blocks.params["embed_blocks"], Q8_0Matrix)
    size = lambda m: sum(a.nbytes for a in jax.tree_util.tree_leaves(m.params["layers"]))
    assert size(blocks) < 0.3 * size(dense)
    if build.load() is None:
        pytest.skip("no C++ compiler: the quantized kernels cannot be built here")
    ids = jnp.asarray(RNG.integers(0, CFG.vocab_size, (1, 12)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(blocks.logits(ids)), np.asarray(dense.logits(ids)))
    ids = jnp.asarray(RNG.integers(0, CFG.vocab_size, (2, 12)), jnp.int32)     # float32's LM head: XLA's GEMM
    np.testing.assert_allclose(np.asarray(blocks.logits(ids)), np.asarray(dense.logits(ids)), atol=1e-5)
    prompts = [RNG.integers(3, CFG.vocab_size, 20).tolist() * 2, RNG.integers(3, CFG.vocab_size, 9).tolist()]
    plain = specjax.generate(dense, prompts, specjax.SpecConfig(max_new_tokens=24)).tokens
    skip = dict(drafter_options=dict(skip_layers=[1]))
    for method, opts in (("none", {}), ("ngram", dict(num_speculative_tokens=4)),       # a chain
                         ("layer_skip", dict(num_speculative_tokens=3, **skip)),      # drafts with the fused layers
                         ("layer_skip", dict(num_steps=2, topk=2, num_draft_tokens=4, **skip))):
        cfg = specjax.SpecConfig(method=method, max_new_tokens=24, **opts)
        assert specjax.generate(blocks, prompts, cfg).tokens == plain, (method, opts)


def test_gguf_int8_is_llama_cpp_arithmetic_near_the_float32_model(q4_1_gguf, tmp_path):
    """load_model(..., weight_format="gguf_int8"): the same blocks in llama.cpp's arithmetic (8-bit activations,
    integer dots), a lossy model near the float32 one; it decodes plain and speculatively (its speculative tokens
    are NOT promised equal to its plain ones: the rest of the forward differs at float32 rounding between a
    one-position step and a verify pass, which quantizing activations can amplify; cpu_kernels/README.md says so)."""
    import specjax
    from cpu_kernels import build
    from specjax.models.weights import Q4_1Int8Matrix, Q8_0Int8Matrix
    if build.load() is None:
        pytest.skip("no C++ compiler: the quantized kernels cannot be built here")
    path = q4_1_gguf
    dense = load_model(path)
    int8 = load_model(path, weight_format="gguf_int8")
    assert isinstance(int8.params["layers"][0]["wqkv"], Q4_1Int8Matrix)
    assert isinstance(int8.params["embed_blocks"], Q8_0Int8Matrix)      # vocab 300 padded to 304 rows
    ids = jnp.asarray(RNG.integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    a, b = np.asarray(dense.logits(ids)), np.asarray(int8.logits(ids))
    assert b.shape == a.shape and not np.array_equal(a, b)              # another function ...
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()                  # ... near the float32 one
    prompts = [RNG.integers(3, CFG.vocab_size, 20).tolist() * 2, RNG.integers(3, CFG.vocab_size, 9).tolist()]
    config = specjax.SpecConfig(max_new_tokens=24)
    plain = specjax.generate(int8, prompts, config).tokens
    assert specjax.generate(int8, prompts, config).tokens == plain       # deterministic
    spec = specjax.generate(int8, prompts, specjax.SpecConfig(method="ngram", num_speculative_tokens=4,
                                                               max_new_tokens=24)).tokens
    assert [len(t) for t in spec] == [len(t) for t in plain]
    with pytest.raises(ValueError, match="weight_format='float32' to save"):
        int8.save_pretrained(tmp_path / "out")


def test_weight_format_shift_reads_zero_for_the_exact_format_and_more_for_int8(q4_1_gguf):
    """experiments.weight_format_shift's measurement: nothing for the GGUF blocks (the float32 model's own values and
    sums), a shift for the 8-bit-activation format."""
    from cpu_kernels import build
    from experiments.weight_format_shift import compare
    if build.load() is None:
        pytest.skip("no C++ compiler: the quantized kernels cannot be built here")
    path = q4_1_gguf
    dense = load_model(path)
    prompts = [RNG.integers(3, CFG.vocab_size, 12).tolist(), RNG.integers(3, CFG.vocab_size, 7).tolist()]
    same = compare(dense, load_model(path, weight_format="gguf"), prompts, 12, "ngram:3")
    # (the teacher-forced logits of 20-odd rows: float32's head takes XLA's GEMM there, the blocks the kernel)
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] < 1e-9 and same["identical_rows"] == 2
    assert same["spec_identical_rows"] == 2 and abs(same["nll_float32"] - same["nll_format"]) < 1e-5
    shifted = compare(dense, load_model(path, weight_format="gguf_int8"), prompts, 12)
    assert shifted["kl_mean"] > 1e3 * max(same["kl_mean"], 1e-12) and "spec_method" not in shifted


def test_gguf_blocks_refuse_what_they_cannot_keep(toy, tmp_path, monkeypatch):
    import specjax
    from specjax.sharding import make_mesh
    monkeypatch.setenv(settings.CACHE_ENV, os.fspath(tmp_path / "cache"))
    path = tmp_path / "toy-q8.gguf"
    write_gguf(path, toy, CFG, Q.Q8_0)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight is Q8_0, not Q4_1"):
        load_model(path, weight_format="gguf")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        load_model(convert_gguf(path, os.fspath(tmp_path / "cache")), weight_format="gguf")
    with pytest.raises(ValueError, match="one of"):
        load_model(path, weight_format="q2")
    q41 = tmp_path / "toy-q4_1.gguf"
    write_gguf(q41, toy, CFG, Q.Q4_1)                                   # an embedding in Q4_1: the head stays float32
    with pytest.raises(ValueError, match="no dtype, no mesh"):
        load_model(q41, dtype=jnp.bfloat16, weight_format="gguf")
    model = load_model(q41, weight_format="gguf")
    assert "embed_blocks" not in model.params
    with pytest.raises(ValueError, match="weight_format='float32' to save"):
        model.save_pretrained(tmp_path / "out")
    with pytest.raises(ValueError, match="not split over a mesh"):
        specjax.generate(model, [[3, 4, 5]], specjax.SpecConfig(max_new_tokens=2), mesh=make_mesh(1, 1, jax.devices()[:1]))
