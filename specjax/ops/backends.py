"""The backend table: which implementation computes an op of specjax.ops, and the one rule that calls it.

Each op's definition is pure jnp (specjax/ops/<op>.py); a backend is another implementation of the same op that
registers here: its kernel, the platforms it runs on, which arguments it takes, whether it can run on this
machine. The op asks `call` for its result; `call` reads the choice in force (specjax.settings: auto, xla or a
backend's name; a per-call override), picks a backend, and traces

  * the definition, where the choice is xla, where no backend takes the arguments, or where the default platform
    is not one of the backend's;
  * otherwise the backend's kernel under lax.platform_dependent, so a program traced here and lowered for another
    platform lowers the definition there; its gradient is the definition's (reference_gradient), unless the
    backend registers without one (an op with no gradient, e.g. an index).

Backends come from two places: the plugin packages named in PLUGINS (cpu_kernels: C++ kernels for a CPU;
pallas_kernels: Pallas attention for GPU and TPU), imported on the first op call when installed (the library
imports neither: without them every op is its definition, lowered by XLA), and register_backend calls of your own.
A backend for one op is one function and one registration line:

    from specjax.ops import Backend, register_backend
    register_backend("rms_norm", Backend("my_norm", my_norm_kernel, platforms=("cpu",)))

then SPECJAX_RMS_NORM_BACKEND=my_norm (or settings.use_backends(rms_norm="my_norm")) selects it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, Callable

import jax

from specjax import settings

__all__ = ["Backend", "PLUGINS", "call", "reference_gradient", "register_backend", "registered_backends",
           "selects"]

# Packages that register backends when imported (each registers in its __init__); optional installs.
PLUGINS = ("cpu_kernels", "pallas_kernels")

log = logging.getLogger(__name__)


def _always(*args, **static) -> bool:
    return True


def _ready() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    kernel      (the op's array arguments..., **the op's static arguments) -> the op's result
    platforms   the JAX platforms its kernel runs on ("cpu", "gpu", "tpu"); None: any (it lowers itself)
    takes       (same arguments) -> bool: whether it computes these shapes, dtypes and weight formats
    available   () -> bool: whether it can run on this machine (e.g. its library built), asked after takes
    auto        picked by the 'auto' choice where it applies (False: only when named)
    gradient    the definition's gradient (kernel values, the definition's VJP); False: the op has none
    """
    name: str
    kernel: Callable[..., Any]
    platforms: tuple[str, ...] | None = ("cpu",)
    takes: Callable[..., bool] = _always
    available: Callable[[], bool] = _ready
    auto: bool = True
    gradient: bool = True


# The table's entries: every op of specjax.settings.OPS, and ops with a second signature whose backends the same
# setting chooses (the rotation of a fused q | k | v is rope's).
SETTING = {**{op: op for op in settings.OPS}, "rope_qkv": "rope"}
_table: dict[str, list[Backend]] = {op: [] for op in SETTING}


def register_backend(op: str, backend: Backend) -> None:
    """Add (or replace, by name) a backend of `op`. Registration order is the 'auto' choice's order of preference."""
    if op not in _table:
        raise ValueError(f"unknown op {op!r}; specjax.ops defines {', '.join(_table)}")
    if backend.name in (settings.AUTO, settings.XLA):
        raise ValueError(f"a backend may not be named {backend.name!r}: that choice means something already")
    entries = _table[op]
    for i, b in enumerate(entries):
        if b.name == backend.name:
            entries[i] = backend
            return
    entries.append(backend)


def registered_backends(op: str) -> tuple[str, ...]:
    """The names of the backends registered for `op` (plugins loaded first)."""
    _load_plugins()
    return tuple(b.name for b in _table[op])


@functools.cache
def _load_plugins() -> None:
    for name in PLUGINS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if e.name != name:
                raise                       # the plugin is there but broken: say so
            log.info("backend plugin %s is not installed; its ops run on XLA", name)


def _named(op: str, name: str) -> Backend:
    for b in _table[op]:
        if b.name == name:
            return b
    raise ValueError(f"no backend named {name!r} for op {op!r}; registered: "
                     f"{', '.join(b.name for b in _table[op]) or 'none'} (or 'auto', 'xla')")


def _runs_here(b: Backend) -> bool:
    return (b.platforms is None or jax.default_backend() in b.platforms) and b.available()


def selects(op: str, name: str, choice: str | None = None) -> bool:
    """Whether the choice in force (or `choice`) would run backend `name` for `op` on this platform, for arguments
    it takes: what a loader asks before laying weights out for that backend."""
    _load_plugins()
    choice = choice or settings.backend(SETTING[op])
    if choice == settings.XLA:
        return False
    if choice != settings.AUTO:
        return choice == name and _runs_here(_named(op, name))
    first = next((b for b in _table[op] if b.auto and _runs_here(b)), None)
    return first is not None and first.name == name


def _pick(op: str, choice: str, args: tuple, static: dict) -> Backend | None:
    if choice == settings.XLA:
        return None
    if choice != settings.AUTO:
        if SETTING[op] != op and all(b.name != choice for b in _table[op]):
            return None                     # a backend of the op whose setting this is, with no second signature
        b = _named(op, choice)
        return b if b.takes(*args, **static) and _runs_here(b) else None
    return next((b for b in _table[op] if b.auto and b.takes(*args, **static) and _runs_here(b)), None)


def call(op: str, definition: Callable[..., Any], *args, choice: str | None = None, options: dict | None = None,
         **static) -> Any:
    """The op's result for array arguments `args` and static (Python) arguments `static`: the chosen backend's
    kernel where it applies, the definition elsewhere (see the module docstring). choice: a per-call override of
    the settings' choice; options: static arguments for the backend's kernel alone (e.g. which lowering of it)."""
    _load_plugins()
    backend = _pick(op, choice or settings.backend(SETTING[op]), args, static)
    reference = functools.partial(definition, **static) if static else definition
    if backend is None:
        return reference(*args)
    kernel_static = {**static, **(options or {})}
    kernel = functools.partial(backend.kernel, **kernel_static) if kernel_static else backend.kernel
    if backend.gradient:
        kernel = reference_gradient(kernel, reference)
    if backend.platforms is None:
        return kernel(*args)
    return jax.lax.platform_dependent(*args, **{p: kernel for p in _lowering_platforms(backend.platforms)},
                                      default=reference)


def _lowering_platforms(platforms: tuple[str, ...]) -> tuple[str, ...]:
    """JAX's platform names ("gpu" is "cuda" or "rocm" to lax.platform_dependent)."""
    return tuple(q for p in platforms for q in (("cuda", "rocm") if p == "gpu" else (p,)))


def reference_gradient(kernel: Callable[..., Any], definition: Callable[..., Any]) -> Callable[..., Any]:
    """kernel's values with definition's gradients: a kernel written for inference (no autodiff rule of its own)
    is differentiable wherever the op's definition is. Both take the same array arguments (static ones bound)."""
    @jax.custom_vjp
    def with_gradient(*args):
        return kernel(*args)

    def forward(*args):
        return kernel(*args), args

    def backward(args, g):
        _, pullback = jax.vjp(definition, *args)
        return pullback(g)

    with_gradient.defvjp(forward, backward)
    return with_gradient
