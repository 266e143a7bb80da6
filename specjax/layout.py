"""Layout arithmetic for a ("data", "model") mesh: which params leaf is split along which axis, how a checkpoint
the model axis does not divide is rearranged (vocabulary padded, kv heads replicated), and the bytes each device
then holds. Pure arithmetic over the model config and array shapes: no I/O and no placement (loading into a
layout is the checkpoint readers' job, placing a generate() call's arrays is specjax.sharding's).

Layout (Megatron-style, so each decoder layer costs two all-reduces over "model"):
  wq/wk/wv [H, heads*D] and w_gate/w_up [H, I]: columns (heads, intermediate) over "model"; bq/bk/bv likewise;
  wo [Hq*D, H] and w_down [I, H]: rows over "model" (their matmul ends in an all-reduce);
  embed [V, H] and lm_head [H, V]: vocabulary over "model"; norms replicated;
  KV cache (one [B, Hkv, S, D] per layer; K [B, Hkv, D, S] on a CPU): batch over "data", kv heads over "model";
  batch rows of every input over "data".
Heads are contiguous blocks, so device i holds q heads i*Hq/m.. and exactly the kv heads they read (GQA groups
never straddle devices). A draft model is a Llama too and gets the same specs; the drafters hold no sharding
code: the jit'd loop is traced under the mesh, KVCache.init pins its buffers to CACHE_SPEC (constrain_cache), and
XLA's sharding propagation does the rest.

Checkpoints the model axis does not divide (Layout, plan_layout): the vocabulary is padded (zero rows, cut off the
logits again by llama.lm_head) and kv heads are replicated when the axis exceeds num_kv_heads; query heads and
the MLP must still split evenly, or validate_mesh names the meshes that work.

Memory arithmetic (memory_per_device), Llama 3.1 70B in bf16 (2 bytes): L=80, H=8192, I=28672, Hq=64, Hkv=8,
D=128, V=128256. Params: per layer 2*H*Hq*D (wq, wo) + 2*H*Hkv*D (wk, wv) + 3*H*I (MLP) + 2*H (norms) = 855.7M;
x80 = 68.45B; embed + lm_head 2*V*H = 2.10B; total 70.55B params = 141.1 GB (131.4 GiB) -- more than any one
device. KV cache per token: 2 (k, v) * L * Hkv * D * 2 bytes = 320 KiB; one 8k-context request = 2.68 GB.
On a (1, 8) mesh: 17.6 GB of target weights and 40 KiB per cached token on each device. A (1, 16) mesh holds each
of the 8 kv heads on 2 devices (kv_repeat 2): half the weights per device but still 40 KiB per token (half of it
the copies), so for capacity (2, 8) beats it on parts that fit 17.6 GB. python -m experiments.tp_memory prints
this for Llama-3.1-8B, Qwen2.5-7B and Llama-3.1-70B on 8 and 16 devices.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:   # type hints only
    from jax.sharding import Mesh


class ModelShape(Protocol):
    """What the layout arithmetic reads of a model's config (specjax.models.config.ModelConfig has it all): the
    layout never builds a config, and naming the class here would put this module above the models, which sit
    above it (their caches are laid out by it)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    tie_word_embeddings: bool


AXES = ("data", "model")

# Spec of each params leaf, by its key in the layout of specjax.models.llama (see its docstring).
_LEAF_SPECS: dict[str, P] = {
    "embed": P("model", None), "lm_head": P(None, "model"), "final_norm": P(),
    "attn_norm": P(), "mlp_norm": P(),
    "wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model"),
    "bq": P("model"), "bk": P("model"), "bv": P("model"),
    "wo": P("model", None), "w_gate": P(None, "model"), "w_up": P(None, "model"), "w_down": P("model", None),
}
CACHE_SPEC = P("data", "model", None, None)              # each layer of KVCache.k / .v [B, Hkv, S or D, D or S]
LENGTHS_SPEC = P("data")                                  # KVCache.lengths [B]


def axis_size(mesh, name: str) -> int:
    """The size of mesh axis `name` (1 when the mesh has no such axis)."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)


# ----------------------------------------------------------------------- layout: vocabulary padding, kv replication

# When the model axis does not divide the vocabulary, it is padded to a multiple of lcm(model, VOCAB_MULTIPLE):
# 128 is the TPU lane width and a multiple of the GPU matmul tiles, so the padded LM head stays tile-friendly.
VOCAB_MULTIPLE = 128


class Layout(NamedTuple):
    """How one Llama's weights are arranged for a "model" axis of size `model` (arithmetic only, no arrays).
    The logical model (ModelConfig) is unchanged; only the placed arrays differ:
      vocab: rows of embed / columns of lm_head as placed (cfg.vocab_size, or padded with zero rows that
        llama.lm_head cuts off the logits, so sampling and verification see exactly cfg.vocab_size tokens);
      kv_heads: kv heads as placed, cfg.num_kv_heads * kv_repeat. With kv_repeat > 1 each kv head's columns of
        wk/wv (bk/bv) are repeated kv_repeat times in a row: a GQA model with kv_repeat x the kv heads, every
        group of copies identical, computes the same attention, and now each device holds the kv head(s) its
        contiguous block of query heads reads (in the weights and in the KV cache), as vLLM and MaxText do."""
    model: int
    vocab: int
    kv_heads: int
    kv_repeat: int


def padded_vocab(vocab_size: int, model: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """vocab_size when `model` divides it (no copy), else the next multiple of lcm(model, multiple)."""
    if vocab_size % model == 0:
        return vocab_size
    step = math.lcm(model, multiple)
    return -(-vocab_size // step) * step


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def working_model_axes(cfg: ModelShape, devices: int | None = None) -> list[int]:
    """Model-axis sizes that can split `cfg` (those dividing num_heads and intermediate_size; the vocabulary is
    padded and kv heads replicated as needed), restricted to divisors of `devices` when given."""
    sizes = [m for m in _divisors(cfg.num_heads) if cfg.intermediate_size % m == 0]
    return [m for m in sizes if devices is None or devices % m == 0]


def plan_layout(cfg: ModelShape, model: int, *, what: str = "model", strict: bool = True,
                devices: int | None = None) -> Layout:
    """The Layout of `cfg` on a model axis of size `model`. strict (a target): raise ValueError naming the
    dimension and the meshes that would work when query heads or the MLP cannot be split evenly. Not strict
    (a draft model, usually small): such dims stay replicated instead (fit_spec), the rest is laid out."""
    bad = [(name, getattr(cfg, name)) for name in ("num_heads", "intermediate_size") if getattr(cfg, name) % model]
    if bad and strict:
        name, v = bad[0]
        n = devices or model
        ok = working_model_axes(cfg, n)
        best = max(ok)
        raise ValueError(
            f"mesh 'model' axis of size {model} does not divide the {what}'s {name}={v}; tensor parallelism gives "
            f"each device whole query heads and an even slice of the MLP (kv heads are replicated and the "
            f"vocabulary padded as needed, but {name} cannot be). Model axis sizes that work on {n} device(s): "
            f"{ok}, e.g. make_mesh(data={n // best}, model={best}). A draft model need not split: load it "
            f"without mesh= and pass it to generate(..., mesh=mesh), which places the dims the axis does not "
            f"divide replicated")
    repeat = 1 if bad else math.lcm(cfg.num_kv_heads, model) // cfg.num_kv_heads
    return Layout(model, padded_vocab(cfg.vocab_size, model), cfg.num_kv_heads * repeat, repeat)


_VOCAB_AXIS = {"embed": 0, "lm_head": 1}             # embed [V, H], lm_head [H, V]
_KV_AXIS = {"wk": 1, "wv": 1, "bk": 0, "bv": 0}      # wk/wv [H, Hkv*D], bk/bv [Hkv*D]


def layout_axis(key: str) -> int | None:
    """The axis of params leaf `key` a Layout may change (vocabulary or kv heads), None for every other leaf."""
    return _VOCAB_AXIS.get(key, _KV_AXIS.get(key))


def layout_index(key: str, n: int, cfg: ModelShape, lay: Layout) -> tuple[int, np.ndarray] | None:
    """For the leaf `key` holding n entries along the axis the layout changes: (that axis, the source index of
    every placed entry, -1 for a zero pad row). None when the leaf is placed as it is (also when it already is
    in this layout, so placing twice is a no-op)."""
    if key in _VOCAB_AXIS:
        if n % lay.model == 0:                       # divisible already (as loaded, or padded before)
            return None
        if n != cfg.vocab_size:
            raise ValueError(f"{key} has {n} vocabulary entries, the config says vocab_size={cfg.vocab_size}")
        idx = np.arange(lay.vocab)
        return _VOCAB_AXIS[key], np.where(idx < n, idx, -1)
    if key in _KV_AXIS:
        D = cfg.head_dim
        if n == lay.kv_heads * D or (n // D) % cfg.num_kv_heads == 0 and (n // D) % lay.model == 0:
            return None                              # already this layout, or replicated enough for this mesh
        if n != cfg.num_kv_heads * D:
            raise ValueError(f"{key} holds {n // D} kv heads: laid out for another mesh (this one places "
                             f"{lay.kv_heads} = {cfg.num_kv_heads} x {lay.kv_repeat}); load the model again")
        col = np.arange(lay.kv_heads * D)
        return _KV_AXIS[key], (col // D // lay.kv_repeat) * D + col % D     # placed kv head j <- j // repeat
    return None


def take_entries(a, axis: int, idx: np.ndarray):
    """a's entries idx (-1 -> zeros) along `axis`; numpy in, numpy out; jax in, jax out."""
    xp = np if isinstance(a, np.ndarray) else jnp
    out = xp.take(a, np.maximum(idx, 0), axis=axis)
    if (idx < 0).any():
        keep = (idx >= 0).reshape([-1 if i == axis else 1 for i in range(a.ndim)])
        out = xp.where(keep, out, xp.zeros((), out.dtype))
    return out


def _key(path) -> str | None:
    return next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), None)


def apply_layout(params: Any, cfg: ModelShape, lay: Layout) -> Any:
    """params (a Llama pytree, numpy or jax leaves) as `lay` places them: vocabulary padded, kv heads repeated.
    Leaves the layout does not change are returned as they are (no copy)."""
    def one(path, x):
        key = _key(path)
        axis = layout_axis(key)
        hit = None if axis is None else layout_index(key, x.shape[axis], cfg, lay)
        return x if hit is None else take_entries(x, *hit)
    return jax.tree_util.tree_map_with_path(one, params)


def logical_params(params: Any, cfg: ModelShape) -> Any:
    """The inverse of apply_layout: vocabulary padding cut off, one copy of each kv head; what cfg describes
    (save_pretrained writes a model placed under a mesh through it)."""
    D, Hkv = cfg.head_dim, cfg.num_kv_heads

    def one(path, x):
        key = _key(path)
        if key in _VOCAB_AXIS and x.shape[_VOCAB_AXIS[key]] != cfg.vocab_size:
            return take_entries(x, _VOCAB_AXIS[key], np.arange(cfg.vocab_size))
        if key in _KV_AXIS and x.shape[_KV_AXIS[key]] != Hkv * D:
            repeat = x.shape[_KV_AXIS[key]] // (Hkv * D)
            col = np.arange(Hkv * D)
            return take_entries(x, _KV_AXIS[key], (col // D) * repeat * D + col % D)   # the first copy of each head
        return x
    return jax.tree_util.tree_map_with_path(one, params)


def validate_mesh(cfg: ModelShape, mesh: Mesh, batch: int | None = None, what: str = "model") -> Layout:
    """-> the Layout of `cfg` on this mesh; raise ValueError naming the dimension (and meshes that would work)
    when the mesh cannot shard this model, or this batch."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES}, got {tuple(mesh.axis_names)}; build it with make_mesh()")
    lay = plan_layout(cfg, axis_size(mesh, "model"), what=what, devices=mesh.size)
    d = axis_size(mesh, "data")
    if batch is not None and batch % d:
        raise ValueError(f"mesh 'data' axis of size {d} does not divide the batch of {batch} rows "
                         f"(generate(mesh=...) pads the batch itself; pad it to a multiple of {d})")
    return lay


def fit_spec(spec: P, shape: tuple[int, ...], mesh) -> P:
    """Drop mesh axes from dims they do not divide (those dims are replicated instead)."""
    return P(*[a if a is None or shape[i] % axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)])


def leaf_spec(key: str) -> P:
    if key not in _LEAF_SPECS:
        raise ValueError(f"no sharding rule for params leaf {key!r}")
    return _LEAF_SPECS[key]


def param_specs(cfg: ModelShape, params: Any, mesh: Mesh | None = None) -> Any:
    """PartitionSpec pytree matching `params`. With `mesh`, dims the mesh axis does not divide are replicated
    (used for small draft models, e.g. 1 kv head on 8 devices); the target is checked by validate_mesh."""
    del cfg  # the layout depends only on the leaf names; cfg is taken for symmetry with validate_mesh
    def spec(path, x):
        s = leaf_spec(_key(path))
        return fit_spec(s, x.shape, mesh) if mesh is not None else s
    return jax.tree_util.tree_map_with_path(spec, params)


def constrain_cache(cache):
    """Pin a KVCache's buffers to CACHE_SPEC when traced under a ("data", "model") mesh (jax.set_mesh);
    a no-op otherwise. Called by KVCache.init, so target and draft caches both start in the layout."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != AXES:
        return cache
    kv = fit_spec(CACHE_SPEC, cache.k[0].shape, mesh)
    wsc = jax.lax.with_sharding_constraint
    pin = lambda bufs: tuple(wsc(x, kv) for x in bufs)
    return cache.replace(k=pin(cache.k), v=pin(cache.v),
                         lengths=wsc(cache.lengths, fit_spec(LENGTHS_SPEC, cache.lengths.shape, mesh)))


# ------------------------------------------------------------------------------------------- memory arithmetic

class DeviceMemory(NamedTuple):
    """Bytes on EACH device of a (data, model) mesh, from the Layout alone (no arrays; exact for the placed
    params: tests/_sharding_worker.py checks it against bytes_per_device)."""
    layout: Layout
    params: int                  # placed parameter bytes on each device (norms replicated on every device)
    params_replication: int      # of which: the extra kv-head copies (kv_repeat > 1)
    params_padding: int          # of which: the vocabulary padding rows
    kv_per_token: int            # KV-cache bytes per cached token of a request, on each device holding its row
    kv_per_token_replication: int  # of which: the extra kv-head copies


def memory_per_device(cfg: ModelShape, data: int, model: int, *, dtype_bytes: int = 2,
                      strict: bool = True) -> DeviceMemory:
    """Per-device parameter and KV-cache bytes of `cfg` on a (data, model) mesh (raises like validate_mesh
    when strict and the mesh cannot split the model). A request's cache lives on the `model` devices of its
    data replica, each holding kv_heads / model heads of every layer."""
    lay = plan_layout(cfg, model, strict=strict, devices=data * model)
    H, I, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    split = lambda n: n // model if n % model == 0 else n     # one sharded dim; fit_spec replicates undividable ones

    bias = (split(Hq * D) + 2 * split(lay.kv_heads * D)) if cfg.attention_bias else 0
    per_layer = 2 * H * split(Hq * D) + 2 * H * split(lay.kv_heads * D) + bias + 3 * H * split(I) + 2 * H
    n_emb = 1 if cfg.tie_word_embeddings else 2
    params = L * per_layer + n_emb * split(lay.vocab) * H + H
    # The overheads, against an even split of the logical model (what a divisible model would cost):
    extra_kv = lay.kv_heads - Hkv
    replication = L * (2 * H + (2 if cfg.attention_bias else 0)) * extra_kv * D // model
    padding = n_emb * (lay.vocab - cfg.vocab_size) * H // model
    kv_tok = 2 * L * split(lay.kv_heads) * D * dtype_bytes
    kv_rep = 2 * L * extra_kv * D * dtype_bytes // model
    return DeviceMemory(lay, params * dtype_bytes, replication * dtype_bytes, padding * dtype_bytes, kv_tok, kv_rep)
