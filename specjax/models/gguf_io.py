"""llama.cpp GGUF files in: Llama-family metadata -> ModelConfig, tensors dequantized to float32 and renamed to
our params, the tokenizer (byte-level BPE) and the chat template from the metadata.

    params, cfg, tokenizer, chat_template = read_gguf("/path/model.Q4_1.gguf")
    hf_dir = convert_gguf("/path/model.Q4_1.gguf")        # once, into the user cache; then an ordinary HF directory

The file is read with the `gguf` package (llama.cpp's own reader). GGUF stores matrices in ggml order (the fastest
axis first), i.e. HF's [out, in] once reversed, and the Q and K projection rows in llama.cpp's rotary order
(llama.cpp's converter interleaves each head's two rotary halves); they are permuted back to HF order, so the
converted directory is what transformers and vLLM load.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from specjax.models.config import ModelConfig, float32_decimal
from specjax.models.hf_io import save_pretrained
from specjax.models.weights import Q4_1Matrix, Q8_0Matrix

# Tensor types read (dequantized to float32); others are refused by name.
READ_TYPES = tuple(GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                       "Q4_K", "Q5_K", "Q6_K"))
ARCHITECTURES = ("llama",)          # general.architecture values whose tensors map onto specjax's Llama
CONVERTED_FORMAT = 1                # bump when the conversion's output changes, so old cache entries are redone

# The pre-tokenizer split of each llama.cpp `tokenizer.ggml.pre` value we know, as a tokenizers pre-tokenizer.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":           # digits one by one, then GPT-2's split (SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not one specjax reads (known: default, gpt2, "
                     "smollm, llama-bpe)")


class _Fields:
    """The metadata of a GGUFReader as plain Python values."""

    def __init__(self, reader: GGUFReader, path: str):
        self.values = {k: f.contents() for k, f in reader.fields.items()}
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.values:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {key!r}")
        return self.values[key]


def _open(path: str) -> GGUFReader:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:   # the reader raises bare ValueError / IndexError / struct errors on a cut file
        raise ValueError(f"cannot read GGUF file {path} (truncated or not a GGUF file?): "
                         f"{type(e).__name__}: {e}") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"GGUF file {path} is truncated: tensor {t.name!r} needs bytes up to "
                             f"{t.data_offset + t.n_bytes} but the file has {size}")
    return reader


def gguf_config(fields: _Fields) -> ModelConfig:
    """Llama-family metadata -> ModelConfig."""
    arch = fields.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {fields.path} holds a {arch!r} model; specjax runs {list(ARCHITECTURES)}")
    a = lambda key: fields.need(f"{arch}.{key}")
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.rope.dimension_count") or hidden // heads)
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.need("tokenizer.ggml.tokens"))
    scaling = fields.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = (("factor", float(fields.need(f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF file {fields.path}: rope scaling {scaling!r} is not supported")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")), num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or heads), head_dim=head_dim,
        family="llama", rope_theta=float(fields.get(f"{arch}.rope.freq_base") or 10000.0), rope_scaling=rope_scaling,
        rms_norm_eps=float32_decimal(a("attention.layer_norm_rms_epsilon")),   # 1e-05, not its f32 image
        tie_word_embeddings=False,             # set by read_gguf from the tensors (no output.weight: tied)
        max_position_embeddings=int(fields.get(f"{arch}.context_length") or 2048),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"), eos_token_id=fields.get("tokenizer.ggml.eos_token_id"))


def gguf_tokenizer(fields: _Fields) -> Tokenizer:
    """The tokenizer in the metadata as a tokenizers.Tokenizer: byte-level BPE (tokenizer.ggml.model "gpt2")
    with its merges and pre-tokenizer, control and user-defined tokens added."""
    model = fields.need("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF file {fields.path}: tokenizer model {model!r} is not read by specjax (byte-level "
                         "BPE, 'gpt2', is)")
    tokens = list(fields.need("tokenizer.ggml.tokens"))
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.need("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    return tok


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves of Q/K projection rows (w [out, in])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(t, path: str) -> np.ndarray:
    """One tensor of a GGUFReader as float32 [out, in] (ggml order reversed); refuses types not in READ_TYPES."""
    if t.tensor_type not in READ_TYPES:
        raise ValueError(f"GGUF file {path}: tensor {t.name!r} is {t.tensor_type.name}, a type specjax does not "
                         f"read (it reads {[q.name for q in READ_TYPES]})")
    shape = tuple(int(n) for n in reversed(t.shape))              # ggml order reversed: [out, in]
    return np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


# specjax layer key -> (GGUF name under blk.{i}., transpose [out, in] -> [in, out])
_LAYER_MAP = {"attn_norm": ("attn_norm", False), "wq": ("attn_q", True), "wk": ("attn_k", True),
              "wv": ("attn_v", True), "wo": ("attn_output", True), "mlp_norm": ("ffn_norm", False),
              "w_gate": ("ffn_gate", True), "w_up": ("ffn_up", True), "w_down": ("ffn_down", True)}


def gguf_blocks(path: str | os.PathLike, cfg: ModelConfig) -> tuple[list[dict], Q8_0Matrix | None]:
    """A GGUF file's own quantized blocks, for the CPU kernel: per decoder layer {key: Q4_1Matrix} of its matrices
    (w [in, out] as specjax stores it; the rotary rows permuted back like the float32 reading), and the token
    embedding as a Q8_0Matrix when it is Q8_0 (else None). Refuses, naming it, a layer matrix of another type."""
    path = os.fspath(path)
    tensors = {t.name: t for t in _open(path).tensors}
    rotary_heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads}

    def blocks(name: str, qtype: GGMLQuantizationType, size: int):
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF file {path} lacks {name}")
        if t.tensor_type != qtype:
            raise ValueError(f"GGUF file {path}: {name} is {t.tensor_type.name}, not {qtype.name} (only Q4_1 layers "
                             f"can be kept as blocks; load the float32 weights instead)")
        rows, cols = (int(n) for n in reversed(t.shape))                       # [out, in]
        return np.asarray(t.data, np.uint8).reshape(rows, cols // 32, size), rows, cols
    f16 = lambda b: b.copy().view(np.float16)[..., 0].astype(np.float32)

    layers = []
    for i in range(cfg.num_layers):
        out = {}
        for key, (name, transpose) in _LAYER_MAP.items():
            if not transpose:                                  # the norms stay float32
                continue
            b, rows, cols = blocks(f"blk.{i}.{name}.weight", GGMLQuantizationType.Q4_1, 20)   # d, m, 16 bytes of q
            d, m, qs = f16(b[..., 0:2]), f16(b[..., 2:4]), b[..., 4:]                        # [out, in / 32] ...
            q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)             # [out, in]
            if key in rotary_heads:
                q, d, m = (_unpermute_rotary(a, rotary_heads[key]) for a in (q, d, m))
            out[key] = Q4_1Matrix.from_blocks(np.ascontiguousarray(q.T), d.T, m.T)
        layers.append(out)
    embed = None
    if tensors["token_embd.weight"].tensor_type == GGMLQuantizationType.Q8_0:
        b, rows, cols = blocks("token_embd.weight", GGMLQuantizationType.Q8_0, 34)         # d, 32 x int8
        embed = Q8_0Matrix(np.ascontiguousarray(b[..., 2:].view(np.int8).reshape(rows, cols)), f16(b[..., 0:2]))
    return layers, embed


def read_gguf(path: str | os.PathLike) -> tuple[dict, ModelConfig, Tokenizer | None, str | None]:
    """A GGUF file -> (float32 numpy params in specjax's layout, ModelConfig, tokenizer or None, chat template or
    None)."""
    path = os.fspath(path)
    reader = _open(path)
    fields = _Fields(reader, path)
    cfg = gguf_config(fields)
    tensors = {t.name: t for t in reader.tensors}
    names = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{g}.weight" for i in range(cfg.num_layers)
                                                            for g, _ in _LAYER_MAP.values()}
    missing = sorted(names - set(tensors))
    if missing:
        raise ValueError(f"GGUF file {path} lacks {len(missing)} tensor(s) a {cfg.num_layers}-layer Llama needs: "
                         f"{missing[:5]}")
    unknown = sorted(set(tensors) - names - {"output.weight", "rope_freqs.weight"})
    if unknown:
        raise ValueError(f"GGUF file {path} has tensors specjax does not know how to use (another architecture "
                         f"variant?): {unknown[:5]}")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"GGUF file {path} carries rope_freqs (Llama 3.1 rope scaling), not supported yet")
    tied = "output.weight" not in tensors
    cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": tied})
    rotary_heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads}

    def layer(i: int) -> dict:
        out = {}
        for key, (name, transpose) in _LAYER_MAP.items():
            w = dequantized(tensors[f"blk.{i}.{name}.weight"], path)
            if key in rotary_heads:
                w = _unpermute_rotary(w, rotary_heads[key])
            out[key] = np.ascontiguousarray(w.T) if transpose else w
        return out
    params = {"embed": dequantized(tensors["token_embd.weight"], path),
              "layers": [layer(i) for i in range(cfg.num_layers)],
              "final_norm": dequantized(tensors["output_norm.weight"], path)}
    if not tied:
        params["lm_head"] = np.ascontiguousarray(dequantized(tensors["output.weight"], path).T)
    if params["embed"].shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"GGUF file {path}: token_embd is {list(params['embed'].shape)}, the metadata says "
                         f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    tokenizer = gguf_tokenizer(fields) if "tokenizer.ggml.tokens" in fields.values else None
    return params, cfg, tokenizer, fields.get("tokenizer.chat_template")


def _file_key(path: str) -> str:
    """A cache key for a GGUF file: its size and the sha256 of its first and last MiB (cheap on a 100 MB file,
    and a different quantization or model changes it)."""
    size, h = os.path.getsize(path), hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read())
    return f"{size}-{h.hexdigest()[:16]}-v{CONVERTED_FORMAT}"


def converted_from(directory: str | os.PathLike) -> str | None:
    """The GGUF file an HF directory of convert_gguf was made from (None: not a conversion)."""
    source = os.path.join(os.fspath(directory), "SOURCE.json")
    if not os.path.isfile(source):
        return None
    with open(source) as f:
        return json.load(f).get("gguf")


def convert_gguf(path: str | os.PathLike, cache: str) -> str:
    """The float32 HF directory of a GGUF file under `cache` (made once; a later call finds it) -> its path.
    Written to a temporary directory and renamed, so an interrupted conversion leaves nothing half-made."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stem = os.path.basename(path)[:-len(".gguf")] if path.endswith(".gguf") else os.path.basename(path)
    key = _file_key(path)
    out = os.path.join(cache, "gguf", f"{stem}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    params, cfg, tokenizer, chat_template = read_gguf(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(out))
    try:
        save_pretrained(params, cfg, tmp, tokenizer=tokenizer, dtype="float32", chat_template=chat_template)
        with open(os.path.join(tmp, "SOURCE.json"), "w") as f:
            json.dump({"gguf": path, "key": key}, f)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        # Another process converted the same file first (os.replace cannot replace a non-empty directory).
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
