"""Scale past one device: a ("data", "model") jax.sharding Mesh; tensor-parallel weights, data-parallel batch.

    mesh = make_mesh(data=2, model=4)
    model = specjax.load_model("/ckpt/llama-70b", dtype=jnp.bfloat16, mesh=mesh)   # straight into the layout
    specjax.generate(model, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4),
                     drafter=draft, mesh=mesh)

Layout (Megatron-style, so each decoder layer costs two all-reduces over "model"):
  wq/wk/wv [H, heads*D] and w_gate/w_up [H, I]: columns (heads, intermediate) over "model"; bq/bk/bv likewise;
  wo [Hq*D, H] and w_down [I, H]: rows over "model" (their matmul ends in an all-reduce);
  embed [V, H] and lm_head [H, V]: vocabulary over "model"; norms replicated;
  KV cache (one [B, Hkv, S, D] per layer; K [B, Hkv, D, S] on a CPU): batch over "data", kv heads over "model";
  batch rows of every input over "data".
Heads are contiguous blocks, so device i holds q heads i*Hq/m.. and exactly the kv heads they read (GQA groups
never straddle devices). A draft model is a Llama too and gets the same specs; the drafters hold no sharding
code: the jit'd loop is traced under the mesh, KVCache.init pins its buffers to CACHE_SPEC (constrain_cache), and XLA's
sharding propagation does the rest. Greedy output is the same tokens as on one device (tests/test_sharding.py).

Multi-host: call jax.distributed.initialize(coordinator, num_processes, process_id) in every process before
any other jax call, then build the same mesh over jax.devices() (all processes' devices) and run the same
generate() everywhere. load_pretrained_sharded reads only the slices of the addressable devices; outputs are
all-gathered so every process gets every row (tests/_multihost_worker.py: 2 processes x 4 CPU devices).

Memory arithmetic, Llama 3.1 70B in bf16 (2 bytes): L=80, H=8192, I=28672, Hq=64, Hkv=8, D=128, V=128256.
  Params: per layer 2*H*Hq*D (wq, wo) + 2*H*Hkv*D (wk, wv) + 3*H*I (MLP) + 2*H (norms) = 855.7M; x80 = 68.45B;
  embed + lm_head 2*V*H = 2.10B; total 70.55B params = 141.1 GB (131.4 GiB) -- more than any one device.
  KV cache per token: 2 (k, v) * L * Hkv * D * 2 bytes = 327,680 B = 320 KiB; one 8k-context request
  (8192 tokens) = 2.68 GB (2.5 GiB). A Llama 3.2 1B drafter adds 2.47 GB of weights and 32 KiB/token
  (0.27 GB per 8k request); its dims divide 8, so it is split like the target.
  8 accelerators, mesh (1, 8): 17.6 GB of target weights per device (+0.31 GB drafter); each device holds 1 of
  the 8 kv heads: 40 KiB/token, 336 MB per 8k request (+34 MB drafter). On 80 GiB parts (H100/A100-80G:
  85.9 GB) ~63 GB stay free after weights and ~5 GB of activations/XLA scratch: ~187 concurrent 8k requests
  (~170 with the drafter's cache), i.e. ~1.5M cached tokens. On 16 GB parts (TPU v5e) the weights alone
  (17.6 GB) do not fit; on 32 GiB parts (TPU v4) ~11 GB remain: ~30 requests of 8k.
  16 accelerators: (2, 8) is two replicas of the 8-way layout, each serving half the batch, so per-device memory
  is as above and the capacity doubles (~370 requests of 8k on 80 GiB parts). (1, 16) holds each of the 8 kv
  heads on 2 devices (Layout below): 8.99 GB of weights per device (+0.17 GB of kv-head copies) and still 40 KiB
  per token per device (half of it the copies), so on 80 GiB parts it serves fewer requests (~214) than (2, 8);
  it is the mesh for 16 x 16 GB parts (TPU v5e-16), which (2, 8) does not fit (~9 requests of 8k).
  python -m experiments.tp_memory prints this for Llama-3.1-8B, Qwen2.5-7B and Llama-3.1-70B on 8 and 16 devices.

Checkpoints the model axis does not divide (Layout, plan_layout): the vocabulary is padded (zero rows, cut off the
logits again by llama.lm_head) and kv heads are replicated when the axis exceeds num_kv_heads; query heads and
the MLP must still split evenly, or validate_mesh names the meshes that work.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

if TYPE_CHECKING:   # a runtime import would cycle: models/__init__ -> llama -> cache -> sharding
    from specjax.models.config import ModelConfig

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


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all of jax.devices(), every process's in multi-host)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but {len(devices)} "
                         f"device(s) were given")
    return Mesh(np.array(devices).reshape(data, model), AXES)


def _axis(mesh, name: str) -> int:
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


def working_model_axes(cfg: ModelConfig, devices: int | None = None) -> list[int]:
    """Model-axis sizes that can split `cfg` (those dividing num_heads and intermediate_size; the vocabulary is
    padded and kv heads replicated as needed), restricted to divisors of `devices` when given."""
    sizes = [m for m in _divisors(cfg.num_heads) if cfg.intermediate_size % m == 0]
    return [m for m in sizes if devices is None or devices % m == 0]


def plan_layout(cfg: ModelConfig, model: int, *, what: str = "model", strict: bool = True,
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
            f"{ok}, e.g. make_mesh(data={n // best}, model={best})")
    repeat = 1 if bad else math.lcm(cfg.num_kv_heads, model) // cfg.num_kv_heads
    return Layout(model, padded_vocab(cfg.vocab_size, model), cfg.num_kv_heads * repeat, repeat)


_VOCAB_AXIS = {"embed": 0, "lm_head": 1}             # embed [V, H], lm_head [H, V]
_KV_AXIS = {"wk": 1, "wv": 1, "bk": 0, "bv": 0}      # wk/wv [H, Hkv*D], bk/bv [Hkv*D]


def layout_index(key: str, n: int, cfg: ModelConfig, lay: Layout) -> tuple[int, np.ndarray] | None:
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


def _take(a, axis: int, idx: np.ndarray):
    """a's entries idx (-1 -> zeros) along `axis`; numpy in, numpy out; jax in, jax out."""
    xp = np if isinstance(a, np.ndarray) else jnp
    out = xp.take(a, np.maximum(idx, 0), axis=axis)
    if (idx < 0).any():
        keep = (idx >= 0).reshape([-1 if i == axis else 1 for i in range(a.ndim)])
        out = xp.where(keep, out, xp.zeros((), out.dtype))
    return out


def _key(path) -> str | None:
    return next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), None)


def apply_layout(params: Any, cfg: ModelConfig, lay: Layout) -> Any:
    """params (a Llama pytree, numpy or jax leaves) as `lay` places them: vocabulary padded, kv heads repeated.
    Leaves the layout does not change are returned as they are (no copy)."""
    def one(path, x):
        key = _key(path)
        axis = _VOCAB_AXIS.get(key, _KV_AXIS.get(key))
        hit = None if axis is None else layout_index(key, x.shape[axis], cfg, lay)
        return x if hit is None else _take(x, *hit)
    return jax.tree_util.tree_map_with_path(one, params)


def logical_params(params: Any, cfg: ModelConfig) -> Any:
    """The inverse of apply_layout: vocabulary padding cut off, one copy of each kv head; what cfg describes
    (save_pretrained writes a model placed under a mesh through it)."""
    D, Hkv = cfg.head_dim, cfg.num_kv_heads

    def one(path, x):
        key = _key(path)
        if key in _VOCAB_AXIS and x.shape[_VOCAB_AXIS[key]] != cfg.vocab_size:
            return _take(x, _VOCAB_AXIS[key], np.arange(cfg.vocab_size))
        if key in _KV_AXIS and x.shape[_KV_AXIS[key]] != Hkv * D:
            repeat = x.shape[_KV_AXIS[key]] // (Hkv * D)
            col = np.arange(Hkv * D)
            return _take(x, _KV_AXIS[key], (col // D) * repeat * D + col % D)   # the first copy of each head
        return x
    return jax.tree_util.tree_map_with_path(one, params)


def validate_mesh(cfg: ModelConfig, mesh: Mesh, batch: int | None = None, what: str = "model") -> Layout:
    """-> the Layout of `cfg` on this mesh; raise ValueError naming the dimension (and meshes that would work)
    when the mesh cannot shard this model, or this batch."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES}, got {tuple(mesh.axis_names)}; build it with make_mesh()")
    lay = plan_layout(cfg, _axis(mesh, "model"), what=what, devices=mesh.size)
    d = _axis(mesh, "data")
    if batch is not None and batch % d:
        raise ValueError(f"mesh 'data' axis of size {d} does not divide the batch of {batch} rows "
                         f"(generate(mesh=...) pads the batch itself; pad it to a multiple of {d})")
    return lay


def fit_spec(spec: P, shape: tuple[int, ...], mesh) -> P:
    """Drop mesh axes from dims they do not divide (those dims are replicated instead)."""
    return P(*[a if a is None or shape[i] % _axis(mesh, a) == 0 else None for i, a in enumerate(spec)])


def leaf_spec(key: str) -> P:
    if key not in _LEAF_SPECS:
        raise ValueError(f"no sharding rule for params leaf {key!r}")
    return _LEAF_SPECS[key]


def param_specs(cfg: ModelConfig, params: Any, mesh: Mesh | None = None) -> Any:
    """PartitionSpec pytree matching `params`. With `mesh`, dims the mesh axis does not divide are replicated
    (used for small draft models, e.g. 1 kv head on 8 devices); the target is checked by validate_mesh."""
    del cfg  # the layout depends only on the leaf names; cfg is taken for symmetry with validate_mesh
    def spec(path, x):
        key = next((p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey)), None)
        s = leaf_spec(key)
        return fit_spec(s, x.shape, mesh) if mesh is not None else s
    return jax.tree_util.tree_map_with_path(spec, params)


def put(x, sharding: NamedSharding) -> jax.Array:
    """Place x (host or device array) with `sharding`; works when the mesh spans several processes too (every
    process passes the same value and fills only its own devices)."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x                                              # already in place: no copy
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh, *, strict: bool = True) -> Any:
    """Lay params out for the mesh (plan_layout: vocabulary padded, kv heads replicated; strict=False for a
    draft model whose heads need not split) and place every leaf with its NamedSharding (dims the mesh does
    not divide stay replicated)."""
    params = apply_layout(params, cfg, plan_layout(cfg, _axis(mesh, "model"), strict=strict, devices=mesh.size))
    specs = param_specs(cfg, params, mesh)
    return jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), params, specs)


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


# ----------------------------------------------------------------------------------- batches for generate()

def pad_rows(x: np.ndarray, multiple: int) -> np.ndarray:
    """Pad the leading (batch) dim to a multiple with copies of the last row: a copy finishes exactly when its
    original does, so dummy rows never keep the decode loop running longer."""
    n = x.shape[0]
    extra = -n % multiple
    return x if not extra else np.concatenate([x, np.repeat(x[-1:], extra, axis=0)], axis=0)


def shard_rows(x, mesh: Mesh) -> jax.Array:
    """Place an array with its leading (batch) dim over "data", the rest replicated."""
    return put(x, NamedSharding(mesh, P("data", *([None] * (np.ndim(x) - 1)))))


def shard_for_generate(mesh: Mesh, model, method: str, drafter: Any, draft_params: Any,
                       rows: Sequence[np.ndarray]):
    """-> (target params, draft params, rows) placed on `mesh`, for specjax.generate(mesh=...).
    The target must shard evenly (validate_mesh; the vocabulary is padded and kv heads replicated as needed).
    The drafter's params are laid out as its registry entry declares: first rearranged by its prepare_params
    (a draft model: the target's rules, leniently), then its own partition specs (e.g. a draft model: the target's Llama layout, dims the mesh does not
    divide replicated), per-request rows (padded like `rows` and split over "data"), or replicated.
    rows: per-request host arrays (prompts, lengths, keys), padded to a multiple of the data axis."""
    from specjax.drafters import registry
    validate_mesh(model.config, mesh)
    d = _axis(mesh, "data")
    rows = [shard_rows(pad_rows(np.asarray(r), d), mesh) for r in rows]
    params = shard_params(model.params, model.config, mesh)
    spec = registry.get(method)
    if spec.per_request_params:
        draft_params = jax.tree_util.tree_map(lambda x: shard_rows(pad_rows(np.asarray(x), d), mesh), draft_params)
    else:
        if spec.prepare_params is not None:      # e.g. a draft model: padded and kv-replicated like the target
            draft_params = spec.prepare_params(drafter, draft_params, mesh)
        specs = (spec.param_specs(drafter, draft_params, mesh) if spec.param_specs is not None
                 else jax.tree_util.tree_map(lambda _: P(), draft_params))
        draft_params = jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), draft_params, specs)
    return params, draft_params, rows


def to_host(x: jax.Array) -> np.ndarray:
    """Whole array on this host; all-gathers across processes when other hosts hold some of the shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# -------------------------------------------------------------------------------------------- sharded loading

def placer(mesh: Mesh, dtype, cfg: ModelConfig) -> Callable[[str, np.ndarray], jax.Array]:
    """place(leaf key, host array) -> sharded jax.Array in the mesh's Layout of cfg. The host array may be a
    lazy memory-mapped (and transposed) view: each device's callback copies only the source rows of its own
    slice (padding rows are zeros, replicated kv heads copied from their one source), so no device, and no
    host buffer, ever holds the whole tensor."""
    np_dtype = np.dtype(dtype)
    lay = plan_layout(cfg, _axis(mesh, "model"), devices=mesh.size)

    def place(key: str, a: np.ndarray) -> jax.Array:
        axis = _VOCAB_AXIS.get(key, _KV_AXIS.get(key))
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
            return _take(block, axis, np.where(src >= 0, src - lo, -1))
        return jax.make_array_from_callback(shape, sharding, slice_of)
    return place


def load_pretrained_sharded(path, mesh: Mesh, dtype=np.float32, *, load_tokenizer_file: bool = True):
    """specjax.models.hf_io.load_pretrained, but each tensor goes straight into its sharded layout on `mesh`.
    The config is validated against the mesh before any weight is read."""
    from specjax.models.hf_io import load_config, load_pretrained
    cfg = load_config(path)
    validate_mesh(cfg, mesh)
    return load_pretrained(path, dtype, load_tokenizer_file=load_tokenizer_file, place=placer(mesh, dtype, cfg))


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of `tree`'s shards resident on each device (replicated leaves count on every device)."""
    out: dict[jax.Device, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


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


def memory_per_device(cfg: ModelConfig, data: int, model: int, *, dtype_bytes: int = 2,
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
