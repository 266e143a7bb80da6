"""Scale past one device: a ("data", "model") jax.sharding Mesh; tensor-parallel weights, data-parallel batch.

    mesh = make_mesh(data=2, model=4)
    model = specjax.load_model("/ckpt/llama-70b", dtype=jnp.bfloat16, mesh=mesh)   # straight into the layout
    specjax.generate(model, prompts, SpecConfig(method="draft_model", num_speculative_tokens=4),
                     drafter=draft, mesh=mesh)

This module places a generate() call's arrays: the target's params, the drafter's (as its registry entry
declares) and the per-request rows. Which leaf is split how, and what a checkpoint the mesh does not divide becomes,
is specjax.layout's arithmetic; loading a checkpoint straight into that layout is the HF reader's
(specjax.models.hf_io.load_pretrained(mesh=...)). Greedy output is the same tokens as on one device.

Multi-host: call jax.distributed.initialize(coordinator, num_processes, process_id) in every process before
any other jax call, then build the same mesh over jax.devices() (all processes' devices) and run the same
generate() everywhere. The sharded loader reads only the slices of the addressable devices; outputs are
all-gathered so every process gets every row.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.drafters import registry
from specjax.layout import AXES, apply_layout, axis_size, param_specs, plan_layout, validate_mesh
from specjax.models.config import ModelConfig
from specjax.models.model import from_panels


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all of jax.devices(), every process's in multi-host)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but {len(devices)} "
                         f"device(s) were given")
    return Mesh(np.array(devices).reshape(data, model), AXES)


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
    params = apply_layout(params, cfg, plan_layout(cfg, axis_size(mesh, "model"), strict=strict, devices=mesh.size))
    specs = param_specs(cfg, params, mesh)
    return jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), params, specs)


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
    validate_mesh(model.config, mesh)
    target_params = from_panels(model.params, model.config)        # panels are one device's layout: row-major here
    blocks = [k for lp in target_params["layers"] for k, w in lp.items() if not hasattr(w, "ndim")]
    if blocks:
        raise ValueError(f"model {model.name!r} keeps its layers as quantized blocks ({blocks[0]}, ...; "
                         f"load_model(weight_format='gguf')), which are not split over a mesh: load it with "
                         f"float32 layers to generate on a mesh")
    if isinstance(draft_params, dict) and "layers" in draft_params and hasattr(drafter, "config"):
        draft_params = from_panels(draft_params, drafter.config)    # a draft model loaded in panels
    d = axis_size(mesh, "data")
    rows = [shard_rows(pad_rows(np.asarray(r), d), mesh) for r in rows]
    params = shard_params(target_params, model.config, mesh)
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
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of `tree`'s shards resident on each device (replicated leaves count on every device)."""
    out: dict[jax.Device, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out
