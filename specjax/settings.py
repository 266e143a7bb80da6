"""Every SPECJAX_ environment variable, read and documented here and nowhere else.

Backends (which implementation computes each op of specjax.ops), read once when this module is imported:

  SPECJAX_BACKEND                every op's choice, unless the op's own variable says otherwise (default: auto)
  SPECJAX_<OP>_BACKEND           one op's choice; <OP> is one of LINEAR, RMS_NORM, ROPE, SWIGLU, ATTENTION,
                                 CACHE_WRITE, GREEDY_TOKEN

  A choice is one of:
    auto        the best backend registered for the platform the op runs on and the arguments it gets: on a CPU the
                CPU kernel (cpu_kernels) where it takes them, elsewhere XLA's lowering of the op's definition
    xla         the op's definition (specjax.ops), lowered by XLA, everywhere
    <backend>   a registered backend by name (cpu_kernel, pallas, or one of your own: specjax.ops.register_backend),
                where it takes the arguments; the definition elsewhere
  SpecConfig.implementation overrides the attention's choice for one generate() call ("pallas", "pallas_gpu",
  "pallas_tpu"); its default "xla" leaves the choice to these settings.
  A program is traced with the choices in force at that moment: use_backends() changes them for a block of code
  (tests and benchmarks comparing backends), clearing JAX's compiled-program caches on the way in and out.

Paths, read where they are used (so a test may point them elsewhere):

  SPECJAX_CACHE                  the user cache (converted models, the compiled CPU kernels); default
                                 $XDG_CACHE_HOME/specjax, else ~/.cache/specjax
  SPECJAX_CHECKPOINTS            a directory of shipped checkpoints searched before the checkout's checkpoints/
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import jax

OPS = ("linear", "rms_norm", "rope", "swiglu", "attention", "cache_write", "greedy_token")
AUTO, XLA = "auto", "xla"
ALL_OPS_ENV = "SPECJAX_BACKEND"
CACHE_ENV = "SPECJAX_CACHE"
CHECKPOINTS_ENV = "SPECJAX_CHECKPOINTS"


def backend_env(op: str) -> str:
    """The environment variable naming one op's backend."""
    return f"SPECJAX_{op.upper()}_BACKEND"


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; specjax.ops defines {', '.join(OPS)}")


def _check_choice(what: str, choice: str) -> str:
    if not isinstance(choice, str) or not choice or not choice.replace("_", "").isalnum():
        raise ValueError(f"{what}: a backend choice is 'auto', 'xla' or a backend's name, got {choice!r}")
    return choice


def _read_environment() -> dict[str, str]:
    every = _check_choice(ALL_OPS_ENV, os.environ.get(ALL_OPS_ENV, AUTO))
    return {op: _check_choice(backend_env(op), os.environ.get(backend_env(op), every)) for op in OPS}


_choices: dict[str, str] = _read_environment()


def backend(op: str) -> str:
    """The backend choice in force for `op` ('auto', 'xla' or a backend's name)."""
    _check_op(op)
    return _choices[op]


def backends() -> tuple[tuple[str, str], ...]:
    """Every op's choice, as a hashable snapshot (a key for caches of compiled programs)."""
    return tuple(sorted(_choices.items()))


@contextlib.contextmanager
def use_backends(default: str | None = None, **choices: str) -> Iterator[None]:
    """Within the block, every op takes `default` (when given) and the ops named take their own choice, e.g.
    use_backends(rms_norm="xla") or use_backends("xla"). JAX's compiled-program caches are cleared on entry and
    exit, so no program traced under other choices is reused."""
    global _choices
    new = dict(_choices)
    if default is not None:
        new = dict.fromkeys(OPS, _check_choice("use_backends", default))
    for op, choice in choices.items():
        _check_op(op)
        new[op] = _check_choice(f"use_backends({op}=...)", choice)
    before, _choices = _choices, new
    jax.clear_caches()
    try:
        yield
    finally:
        _choices = before
        jax.clear_caches()


def cache_dir() -> str:
    """The user cache: $SPECJAX_CACHE, else $XDG_CACHE_HOME/specjax, else ~/.cache/specjax."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specjax")


def checkpoints_dir() -> str | None:
    """$SPECJAX_CHECKPOINTS: a directory of shipped checkpoints (None when unset)."""
    return os.environ.get(CHECKPOINTS_ENV) or None
