"""Hugging Face checkpoint I/O for the Llama family (Llama 2/3, Mistral, Qwen2).

    params, cfg, tokenizer = load_pretrained("/path/to/hf_dir")          # tokenizer is None without tokenizer.json
    save_pretrained(params, cfg, "/path/out", tokenizer=tokenizer, dtype="bfloat16", max_shard_bytes=2**30)

A directory holds config.json, either model.safetensors or model.safetensors.index.json plus its shards, and
optionally tokenizer.json. HF Linear weights are [out, in]; specjax matrices are [in, out], so they are transposed
on the way in and out. Tied embeddings (tie_word_embeddings=True) mean no "lm_head" entry in params.

Safetensors files are parsed here directly (8-byte little-endian header length, JSON header, raw little-endian
data), memory-mapped with numpy; this reads BF16 (via ml_dtypes) which safetensors' numpy backend cannot, and lets
a truncated or corrupt file fail with a message naming the file. Writing goes through safetensors.numpy.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from specjax.layout import axis_size, fit_spec, layout_axis, layout_index, leaf_spec, logical_params, plan_layout, \
    take_entries, validate_mesh
from specjax.models.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensors some checkpoints carry that the model recomputes (old Llama exports store the RoPE inverse frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------------- name mapping

def _layer_map(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(specjax key, HF suffix under model.layers.{i}., transpose?) for one decoder layer."""
    m = [("attn_norm", "input_layernorm.weight", False),
         ("wq", "self_attn.q_proj.weight", True), ("wk", "self_attn.k_proj.weight", True),
         ("wv", "self_attn.v_proj.weight", True), ("wo", "self_attn.o_proj.weight", True),
         ("mlp_norm", "post_attention_layernorm.weight", False),
         ("w_gate", "mlp.gate_proj.weight", True), ("w_up", "mlp.up_proj.weight", True),
         ("w_down", "mlp.down_proj.weight", True)]
    if cfg.attention_bias:
        m += [("bq", "self_attn.q_proj.bias", False), ("bk", "self_attn.k_proj.bias", False),
              ("bv", "self_attn.v_proj.bias", False)]
    return m


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape ([out, in] for Linear weights) implied by the config."""
    H, I, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    per_layer = {"input_layernorm.weight": (H,), "self_attn.q_proj.weight": (q, H),
                 "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
                 "self_attn.o_proj.weight": (H, q), "post_attention_layernorm.weight": (H,),
                 "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
                 "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        for _, suffix, _ in _layer_map(cfg):
            out[f"model.layers.{i}.{suffix}"] = per_layer[suffix]
    return out


# ----------------------------------------------------------------------------------------- safetensors reading

class SafetensorsFile:
    """Minimal validated reader: header parsed eagerly, tensors memory-mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file not found: {path}")
        size = os.path.getsize(path)
        if size < 8:
            raise ValueError(f"corrupt safetensors file {path}: only {size} bytes, too short for a header "
                             f"(truncated?)")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > 100 * 2 ** 20:
                raise ValueError(f"corrupt safetensors file {path}: header length {n} exceeds the file size "
                                 f"{size} (truncated or not a safetensors file)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"corrupt safetensors file {path}: cannot parse the JSON header ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dt, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"corrupt safetensors file {path}: malformed header entry for {name!r}") from None
            if dt not in _ST_DTYPES:
                raise ValueError(f"unsupported dtype {dt} for tensor {name!r} in {path}")
            np_dt = _ST_DTYPES[dt]
            if end > data_size:
                raise ValueError(f"corrupt safetensors file {path}: tensor {name!r} needs bytes up to {end} of the "
                                 f"data section but the file has only {data_size} (truncated file?)")
            if begin < 0 or end - begin != math.prod(shape) * np_dt.itemsize:
                raise ValueError(f"corrupt safetensors file {path}: tensor {name!r} has byte range "
                                 f"[{begin}, {end}) inconsistent with dtype {dt} and shape {list(shape)}")
            self.entries[name] = (np_dt, shape, begin, end)
        self._mm = None

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def get(self, name: str) -> np.ndarray:
        np_dt, shape, begin, end = self.entries[name]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mm[self.data_start + begin: self.data_start + end]
        return np.frombuffer(buf, dtype=np_dt).reshape(shape)


def _open_weights(path: str) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the file holding it."""
    single, index = os.path.join(path, WEIGHTS_NAME), os.path.join(path, INDEX_NAME)
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return {k: f for k in f.keys()}
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt index file {index}: expected JSON with a 'weight_map' ({e!r})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"index file {index} names shard(s) that do not exist in {path}: {missing}")
        files = {s: SafetensorsFile(os.path.join(path, s)) for s in shards}
        out = {}
        for name, shard in weight_map.items():
            if name not in files[shard].entries:
                raise ValueError(f"index file {index} maps tensor {name!r} to shard {shard}, which does not "
                                 f"contain it")
            out[name] = files[shard]
        return out
    others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf"))]
    hint = f" (found {others}: only safetensors checkpoints are supported; convert them first)" if others else ""
    raise FileNotFoundError(f"no weights in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME}{hint}")


# ---------------------------------------------------------------------------------------------------- loading

def load_config(path: str) -> ModelConfig:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"missing {CONFIG_NAME} in checkpoint directory {path}")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ValueError(f"cannot parse {cfg_path}: {e}") from None
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{cfg_path}: unsupported hidden_act={act!r} (specjax implements SiLU-gated MLPs)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{cfg_path}: mlp_bias=True is not supported")
    try:
        cfg = ModelConfig.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{cfg_path} lacks required field {e}") from None
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    if cfg.family == "llama" and cfg.attention_bias:
        raise ValueError(f"{cfg_path}: Llama attention_bias=True (o_proj bias) is not supported")
    return cfg


def load_tokenizer(path: str, cfg: ModelConfig | None = None):
    """tokenizers.Tokenizer from path/tokenizer.json, or None when the file is absent."""
    tok_path = os.path.join(os.fspath(path), TOKENIZER_NAME)
    if not os.path.isfile(tok_path):
        return None
    try:
        tok = Tokenizer.from_file(tok_path)
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"cannot load tokenizer {tok_path}: {e}") from None
    if cfg is not None:
        n = tok.get_vocab_size(with_added_tokens=True)
        if n > cfg.vocab_size:
            raise ValueError(f"tokenizer/model vocab size mismatch: {tok_path} has {n} tokens but the model's "
                             f"vocab_size is {cfg.vocab_size}; token ids >= {cfg.vocab_size} would have no "
                             f"embedding")
    return tok


def load_chat_template(path: str) -> str | None:
    """The chat template of a checkpoint directory (tokenizer_config.json's chat_template, or a
    chat_template.jinja file), None when it has none."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return None
    try:
        with open(cfg_path) as f:
            template = json.load(f).get("chat_template")
    except ValueError as e:
        raise ValueError(f"cannot parse {cfg_path}: {e}") from None
    return template if isinstance(template, str) else None


def load_pretrained(path, dtype=jnp.float32, *, load_tokenizer_file: bool = True, mesh: Mesh | None = None):
    """Read a Hugging Face Llama/Mistral/Qwen2 checkpoint directory -> (params, ModelConfig, tokenizer or None).
    mesh: a ("data", "model") mesh (specjax.sharding.make_mesh); each tensor then goes straight into its layout
    on it (specjax.layout), each device copying only its own slice, after the config is checked against the mesh
    and before any weight is read."""
    path = os.fspath(path)
    cfg = load_config(path)
    if mesh is not None:
        validate_mesh(cfg, mesh)
    place = None if mesh is None else _placer(mesh, dtype, cfg)
    tensors = _open_weights(path)
    # Base-model exports (LlamaModel) drop the "model." prefix; accept them.
    if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in tensors.items()}
    expected = _expected_shapes(cfg)
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s) the config requires: "
                         f"{missing[:5]}{more}")
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [k for k in tensors if k not in expected and k not in allowed_extra
                  and not k.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"checkpoint {path} has tensor(s) specjax does not know how to use (unsupported "
                         f"architecture variant?): {unexpected[:5]}{more}")
    bad = [(k, tensors[k].shape(k), shp) for k, shp in expected.items() if tuple(tensors[k].shape(k)) != shp]
    if bad:
        desc = "; ".join(f"{k}: checkpoint {list(got)} vs config {list(want)}" for k, got, want in bad[:5])
        raise ValueError(f"tensor shape mismatch between {path} weights and {CONFIG_NAME}: {desc}")

    def get(name: str, transpose: bool, key: str):
        a = tensors[name].get(name)
        if transpose:
            a = a.T
        if place is not None:
            return place(key, a)
        return jnp.asarray(np.array(a), dtype=dtype)         # np.array: copy out of the memory map

    layers = []
    for i in range(cfg.num_layers):
        layers.append({key: get(f"model.layers.{i}.{suffix}", tr, key) for key, suffix, tr in _layer_map(cfg)})
    params = {"embed": get("model.embed_tokens.weight", False, "embed"), "layers": layers,
              "final_norm": get("model.norm.weight", False, "final_norm")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", True, "lm_head")
    tok = load_tokenizer(path, cfg) if load_tokenizer_file else None
    return params, cfg, tok


def _placer(mesh: Mesh, dtype, cfg: ModelConfig):
    """place(leaf key, host array) -> sharded jax.Array in the mesh's Layout of cfg. The host array may be a
    lazy memory-mapped (and transposed) view: each device's callback copies only the source rows of its own
    slice (padding rows are zeros, replicated kv heads copied from their one source), so no device, and no
    host buffer, ever holds the whole tensor."""
    np_dtype = np.dtype(dtype)
    lay = plan_layout(cfg, axis_size(mesh, "model"), devices=mesh.size)

    def place(key: str, a: np.ndarray) -> jax.Array:
        axis = layout_axis(key)
        hit = layout_index(key, a.shape[axis], cfg, lay) if axis is not None else None
        shape = tuple(a.shape) if hit is None else a.shape[:axis] + (len(hit[1]),) + a.shape[axis + 1:]
        sharding = NamedSharding(mesh, fit_spec(leaf_spec(key), shape, mesh))

        def slice_of(index):
            if hit is None:
                return np.asarray(a[index], dtype=np_dtype)
            index = tuple(index) + (slice(None),) * (a.ndim - len(index))
            src = hit[1][index[axis]]                                 # source entries of this slice, -1: pad
            valid = src[src >= 0]
            lo, hi = (int(valid.min()), int(valid.max()) + 1) if valid.size else (0, 1)
            block = np.asarray(a[index[:axis] + (slice(lo, hi),) + index[axis + 1:]], dtype=np_dtype)
            return take_entries(block, axis, np.where(src >= 0, src - lo, -1))
        return jax.make_array_from_callback(shape, sharding, slice_of)
    return place


# ----------------------------------------------------------------------------------------------------- saving

def _to_hf_tensors(params: dict, cfg: ModelConfig, np_dtype) -> dict[str, np.ndarray]:
    def conv(x, transpose):
        a = np.asarray(x)
        if a.dtype != np.float32:
            a = a.astype(np.float32)
        if transpose:
            a = a.T
        return np.ascontiguousarray(a.astype(np_dtype))

    if len(params["layers"]) != cfg.num_layers:
        raise ValueError(f"params have {len(params['layers'])} layers but cfg.num_layers={cfg.num_layers}")
    params = logical_params(params, cfg)          # a model placed under a mesh: padding and kv copies dropped
    out = {"model.embed_tokens.weight": conv(params["embed"], False)}
    for i, lp in enumerate(params["layers"]):
        for key, suffix, tr in _layer_map(cfg):
            out[f"model.layers.{i}.{suffix}"] = conv(lp[key], tr)
    out["model.norm.weight"] = conv(params["final_norm"], False)
    if not cfg.tie_word_embeddings:
        if "lm_head" not in params:
            raise ValueError("cfg.tie_word_embeddings=False but params have no 'lm_head'")
        out["lm_head.weight"] = conv(params["lm_head"], True)
    expected = _expected_shapes(cfg)
    bad = [(k, v.shape, expected[k]) for k, v in out.items() if tuple(v.shape) != expected[k]]
    if bad:
        raise ValueError(f"params do not match cfg: {[f'{k}: {list(g)} vs {list(w)}' for k, g, w in bad[:5]]}")
    return out


def write_tokenizer_config(path: str, tokenizer, cfg: ModelConfig, chat_template: str | None) -> None:
    """tokenizer_config.json for transformers / vLLM: the special tokens by string and the chat template."""
    tok = lambda i: tokenizer.id_to_token(i) if i is not None else None
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok(cfg.bos_token_id),
                   "eos_token": tok(cfg.eos_token_id), "pad_token": tok(cfg.eos_token_id), "add_bos_token": False,
                   "model_max_length": cfg.max_position_embeddings, "chat_template": chat_template},
                  f, indent=1, ensure_ascii=False)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                   "pad_token_id": cfg.eos_token_id}, f)


def save_pretrained(params: dict, cfg: ModelConfig, path, tokenizer=None, dtype: Any = "float32",
                    max_shard_bytes: int | None = None, chat_template: str | None = None) -> None:
    """Write a transformers- and vLLM-loadable checkpoint: config.json, model.safetensors (or shards + index when
    max_shard_bytes is given and the weights exceed it), and with a tokenizer tokenizer.json, tokenizer_config.json
    (special tokens, chat_template) and generation_config.json."""
    path = os.fspath(path)
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _SAVE_DTYPES:
        raise ValueError(f"unsupported save dtype {dtype!r}; use one of {sorted(_SAVE_DTYPES)}")
    os.makedirs(path, exist_ok=True)
    tensors = _to_hf_tensors(params, cfg, _SAVE_DTYPES[name])

    hf = cfg.to_hf()
    hf["torch_dtype"] = name
    hf["dtype"] = name
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)

    # Remove stale weights from a previous save in another layout, so the loader cannot pick the wrong one.
    for fname in os.listdir(path):
        if fname == WEIGHTS_NAME or fname == INDEX_NAME or (fname.startswith("model-") and
                                                             fname.endswith(".safetensors")):
            os.remove(os.path.join(path, fname))

    meta = {"format": "pt"}
    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata=meta)
    else:
        shards, cur, cur_bytes = [], {}, 0
        for k, a in tensors.items():
            if cur and cur_bytes + a.nbytes > max_shard_bytes:
                shards.append(cur)
                cur, cur_bytes = {}, 0
            cur[k] = a
            cur_bytes += a.nbytes
        if cur:
            shards.append(cur)
        weight_map = {}
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata=meta)
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    if tokenizer is not None:
        tok_path = os.path.join(path, TOKENIZER_NAME)
        if os.path.islink(tok_path):       # a shipped directory shares its target's file: never write through it
            os.remove(tok_path)
        if hasattr(tokenizer, "save") and not hasattr(tokenizer, "save_pretrained"):
            tokenizer.save(tok_path)                          # tokenizers.Tokenizer
            write_tokenizer_config(path, tokenizer, cfg, chat_template)
        elif hasattr(tokenizer, "backend_tokenizer"):
            tokenizer.backend_tokenizer.save(tok_path)        # transformers fast tokenizer
        else:
            raise TypeError(f"cannot save tokenizer of type {type(tokenizer).__name__}; pass a "
                            f"tokenizers.Tokenizer")
