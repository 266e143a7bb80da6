"""Where a target forward's time goes on this machine: its cost over T = 1, 2, 3, 5, 9, 17 positions relative to
T = 1 (the verify-cost ratio of a (T-1)-token chain), beside the machine's compute floor, and a breakdown of each
forward by XLA operation or CPU kernel.

  python -m experiments.forward_profile                                  # SmolLM2-135M and the toy
  python -m experiments.forward_profile --matmul=kernel,xla --nobreakdown     # the small-M kernel vs XLA's dot

The manual (the paths compared, the cost, the breakdown, the compute floor): docs/forward_profile.md.
"""
from __future__ import annotations

import contextlib
import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags
import jax
import jax.numpy as jnp

import specjax
from experiments import costs
from experiments.tables import text_table, write_table
from specjax import checkpoints, settings
from specjax.models.config import ModelConfig
from specjax.models.llama import init_params
from specjax.models.model import Model, weight_arrays

FLAGS = flags.FLAGS
BREAKDOWNS = ("signature", "kind")     # what a breakdown sums its thread time under (breakdown's `by`)

# Architectures for `random:<shape>` targets (tied embeddings as in the published models).
RANDOM_SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                tie_word_embeddings=True),
    "llama-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                            tie_word_embeddings=True),
}
MATMUL_KINDS = ("dot", "ynn_fusion", "copy_dot_fusion", "xnn_fusion", "onednn_fusion", "specjax_small_m_matmul")


def is_matmul(operation: str) -> bool:
    """A breakdown key (a kind, or a signature: the kind or kernel, then the shape) that is a matrix product."""
    return operation.split(" ")[0].startswith(MATMUL_KINDS)
INNER = 8


def breakdown(model, T: int, batch: int, context: int, calls: int = 3,
              by: str = "signature") -> dict[str, tuple[float, float]]:
    """{operation: (thread ms per forward, executions per forward)} from a profile of `calls` calls. by: "kind"
    (the HLO name less its number: every CPU kernel is one `ffi_call`) or "signature" (costs.hlo_signatures: the
    kernel or opcode with its result shape, e.g. `specjax_verify_attention f32[1,5,9,64]`)."""
    if by not in BREAKDOWNS:
        raise ValueError(f"breakdown by={by!r}: one of {list(BREAKDOWNS)}")
    fn, params, cache = costs.looped_forward(model, context, T, batch, inner=INNER)
    # compiled once: the program profiled is the one whose text names its operations (lowering donates nothing)
    compiled = fn.func.lower(params, cache, **fn.keywords).compile()
    names = costs.hlo_signatures(compiled.as_text()) if by == "signature" else None
    fresh = lambda: jax.tree.map(jnp.copy, cache)               # the loop donates its cache
    jax.block_until_ready(compiled(params, fresh()))
    caches = iter([jax.block_until_ready(fresh()) for _ in range(calls)])    # copied before the profile
    kinds = costs.thunk_profile(lambda: compiled(params, next(caches)), calls, names)
    n = calls * INNER
    return {kind: (ms / n, count / n) for kind, (ms, count) in kinds.items()}


# The ops each path choice governs (specjax.settings): "kernel" leaves their backend choice at auto (the CPU kernels
# where they apply), "xla" computes them by their XLA-lowered definitions.
MATMUL_OPS = ("linear",)
LAYER_OPS = ("attention", "rope", "rms_norm", "cache_write", "swiglu")
PATHS = ("kernel", "xla")


@contextlib.contextmanager
def kernel_paths(matmul: str, layer_ops: str):
    """Trace inside with the given paths for the matmuls and for attention / RoPE / RMS norm / cache write /
    SwiGLU."""
    choices = {op: "auto" if path == "kernel" else "xla"
               for ops_, path in ((MATMUL_OPS, matmul), (LAYER_OPS, layer_ops)) for op in ops_}
    with settings.use_backends(**choices):
        yield


def load_target(name: str, weights: str, dtype) -> specjax.Model:
    """A shipped / installed / directory target, or `random:<shape>` (RANDOM_SHAPES) with random weights."""
    if not name.startswith("random:"):
        return specjax.load_model(name, weight_format=weights, dtype=dtype)
    shape = name.split(":", 1)[1]
    if shape not in RANDOM_SHAPES:
        raise app.UsageError(f"unknown random target shape {shape!r}: choose from {sorted(RANDOM_SHAPES)}")
    return Model(RANDOM_SHAPES[shape], init_params(RANDOM_SHAPES[shape], jax.random.PRNGKey(0), dtype), name=name)


def define_flags() -> None:
    """The entry point's flags (defined only when run as a program, so tests import this module beside others)."""
    flags.DEFINE_list("targets", ["smollm2-135m", "stdlib-target"], "targets (names or directories load_model takes)")
    flags.DEFINE_list("positions", ["1", "2", "3", "5", "9", "17"], "T: positions per forward")
    flags.DEFINE_integer("context", 332, "tokens of history in the cache")
    flags.DEFINE_integer("batch", 1, "rows per forward")
    flags.DEFINE_integer("top", 8, "operation kinds listed per forward")
    flags.DEFINE_bool("breakdown", True, "profile each forward by XLA operation")
    flags.DEFINE_enum("breakdown_by", "signature", list(BREAKDOWNS), "the breakdown's key: signature (the CPU "
                      "kernel or XLA opcode and its result shape) or kind (the HLO name less its number; the CPU "
                      "kernels all `ffi_call`)")
    flags.DEFINE_list("weight_format", ["auto"], "the target's weights, side by side: auto (load_model's "
                      "default), float32 (row-major), panels (the same values in the kernel's panels), gguf, "
                      "gguf_int8 (a GGUF target's own blocks, load_model(weight_format=); other targets without "
                      "them; random targets in float32 only)")
    flags.DEFINE_list("matmul", ["kernel"], "matmul paths, measured side by side: kernel (the default), xla")
    flags.DEFINE_list("layer_ops", ["kernel"], "attention / RoPE / RMS norm / cache write paths, measured side by "
                      "side: kernel (the default), xla")
    flags.DEFINE_integer("rounds", 1, "sweeps over every (T, format, path) in turn; each keeps its fastest (a noisy "
                         "machine's slow phases hit every cell alike)")
    flags.DEFINE_list("implementation", ["xla"], "attention paths, measured side by side: xla, pallas")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the weights' (and KV cache's) dtype")
    flags.DEFINE_bool("roofline", True, "also measure this machine's float32 matmul peak (costs.machine_roofline) "
                      "and give each row the FLOP rate it reached and its compute floor: the T-position forward's "
                      "FLOPs at that peak over the measured T = 1 time, the least vs_one this machine allows unless "
                      "T = 1 itself got slower")
    flags.DEFINE_string("out", "runs/forward_profile", "path stem of the table")


def main(argv):
    rows, summary = [], []
    dtype = jnp.dtype(FLAGS.dtype)
    positions = [int(t) for t in FLAGS.positions]
    for flag in ("matmul", "layer_ops"):
        unknown = set(FLAGS[flag].value) - set(PATHS)
        if unknown:                                      # before any measurement
            raise app.UsageError(f"unknown --{flag} paths {sorted(unknown)}: choose from {list(PATHS)}")
    peak_flops = costs.machine_roofline()[0] if FLAGS.roofline else None
    if peak_flops:
        print(f"float32 matmul peak (XLA, 1024^3): {peak_flops / 1e9:.1f} GFLOP/s")
    for name in FLAGS.targets:
        models = {}                  # every format of this target, measured side by side (for each T, in turn)
        for weights in FLAGS.weight_format:
            if weights not in ("auto", "float32") and name.startswith("random:"):
                print(f"{name}: random weights, measured with float32 layers only")
                continue
            if weights.startswith("gguf") and not checkpoints.resolve(name, "model").endswith(".gguf"):
                print(f"{name}: not a GGUF model, measured without its {weights} format")
                continue
            models[weights] = load_target(name, weights, dtype)
        weight_bytes = {w: sum(x.nbytes for x in weight_arrays(m.params)) for w, m in models.items()}
        cells = list(itertools.product(positions, models, FLAGS.matmul, FLAGS.layer_ops, FLAGS.implementation))
        seconds = {}                 # the fastest of --rounds sweeps (a sweep is every cell once, in turn)
        for _ in range(FLAGS.rounds):
            for T, weights, path, ops, impl in cells:
                with kernel_paths(path, ops):
                    s = costs.forward_seconds(models[weights], FLAGS.context, T, batch=FLAGS.batch, budget_s=3.0,
                                              implementation=impl)
                seconds[T, weights, path, ops, impl] = min(s, seconds.get((T, weights, path, ops, impl), s))
        for T, weights, path, ops, impl in cells:
            model, sec = models[weights], seconds[T, weights, path, ops, impl]
            one = seconds[positions[0], weights, path, ops, impl]
            label = (name if weights == "float32" else f"{name} ({weights})") + (
                f" [{impl}]" if len(FLAGS.implementation) > 1 else "")
            row = dict(target=name, weight_format=weights, matmul=path, layer_ops=ops, implementation=impl,
                       dtype=FLAGS.dtype, batch=FLAGS.batch, context=FLAGS.context,
                       positions=T, ms=sec * 1e3, vs_one=sec / one, weight_GB_s=weight_bytes[weights] / sec / 1e9)
            if peak_flops:
                flops = T * FLAGS.batch * costs.roofline_inputs(model, FLAGS.context)["flops_per_token"]
                row.update(gflop_s=flops / sec / 1e9, compute_floor_vs_one=max(one, flops / peak_flops) / one)
            if FLAGS.breakdown:
                with kernel_paths(path, ops):
                    kinds = breakdown(model, T, FLAGS.batch, FLAGS.context, by=FLAGS.breakdown_by)
                matmul_ms = sum(ms for k, (ms, _) in kinds.items() if is_matmul(k))
                row.update(thread_ms=sum(ms for ms, _ in kinds.values()), matmul_thread_ms=matmul_ms,
                           matmul_GB_s=weight_bytes[weights] / (matmul_ms / 1e3) / 1e9 if matmul_ms else None,
                           ops={k: {"thread_ms": round(ms, 3), "per_forward": round(c, 1)}
                                for k, (ms, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0])})
                top = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:FLAGS.top]
                summary.append([label, path, ops, T, f"{sec * 1e3:.2f}", f"{sec / one:.2f}",
                                "; ".join(f"{k} {ms:.2f} ms x{c:.0f}" for k, (ms, c) in top)])
            rows.append(row)
            print(f"{label} matmul {path} layer ops {ops} T={T}: {sec * 1e3:.2f} ms, {sec / one:.2f}x T={positions[0]}"
                  + (f", matmuls {row['matmul_thread_ms']:.2f} thread ms" if FLAGS.breakdown else "")
                  + (f", {row['gflop_s']:.1f} GFLOP/s, compute floor {row['compute_floor_vs_one']:.2f}x"
                     if peak_flops else ""), flush=True)
    header = ["target", "matmul", "layer ops", "T", "ms", "vs T=1", "operation kinds (thread ms per forward x executions)"]
    if summary:
        print(text_table(header, summary))
    write_table(rows, FLAGS.out, {"positions": positions, "context": FLAGS.context, "batch": FLAGS.batch,
                                  "inner": INNER, "matmul": FLAGS.matmul, "layer_ops": FLAGS.layer_ops,
                                  "implementation": FLAGS.implementation, "dtype": FLAGS.dtype,
                                  "devices": str(jax.devices()),
                                  "rounds": FLAGS.rounds, "peak_gflop_s": peak_flops and peak_flops / 1e9,
                                  "weight_format": FLAGS.weight_format})


if __name__ == "__main__":
    define_flags()
    app.run(main)
