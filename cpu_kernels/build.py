"""Compiles the CPU kernels (every cpu_kernels/*/kernel.cc, one shared object) once per machine into the user cache
and registers their FFI targets with XLA:CPU.

The shared object is keyed by the sources, the jaxlib headers' version, the compiler and the CPU's instruction-set
flags (it is built with -march=native), so a changed kernel, jaxlib or machine builds a fresh one. Nothing happens at
import: the first call of `load()` builds (a few seconds) and registers; a machine without a C++ compiler gets None
and the callers use XLA's dot.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax
import jaxlib

from specjax import settings

TARGET = "specjax_small_m_matmul"
PANELS_TARGET = "specjax_small_m_matmul_panels"
Q4_1_TARGET = "specjax_small_m_matmul_q4_1"
Q8_0_TARGET = "specjax_small_m_matmul_q8_0"
Q4_1_INT8_TARGET = "specjax_small_m_matmul_q4_1_int8"
Q8_0_INT8_TARGET = "specjax_small_m_matmul_q8_0_int8"
VERIFY_ATTENTION_TARGET = "specjax_verify_attention"
ROPE_TARGET = "specjax_rope"
ROPE_QKV_TARGET = "specjax_rope_qkv"
RMS_NORM_TARGET = "specjax_rms_norm"
CACHE_WRITE_TARGET = "specjax_cache_write"
SWIGLU_TARGET = "specjax_swiglu"
GREEDY_TOKEN_TARGET = "specjax_greedy_token"
ROOT = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(ROOT, kernel, "kernel.cc") for kernel in ("small_m_matmul", "verify_attention", "rope",
                                                                    "rms_norm", "cache_write", "swiglu",
                                                                    "greedy_token"))
HEADERS = (os.path.join(ROOT, "common.h"),)
# (FFI target, the library's handler symbol)
HANDLERS = ((TARGET, "SpecjaxSmallMMatmul"), (PANELS_TARGET, "SpecjaxSmallMMatmulPanels"),
            (Q4_1_TARGET, "SpecjaxSmallMMatmulQ41"),
            (Q8_0_TARGET, "SpecjaxSmallMMatmulQ80"), (Q4_1_INT8_TARGET, "SpecjaxSmallMMatmulQ41Int8"),
            (Q8_0_INT8_TARGET, "SpecjaxSmallMMatmulQ80Int8"), (VERIFY_ATTENTION_TARGET, "SpecjaxVerifyAttention"),
            (ROPE_TARGET, "SpecjaxRope"), (ROPE_QKV_TARGET, "SpecjaxRopeQkv"), (RMS_NORM_TARGET, "SpecjaxRmsNorm"),
            (CACHE_WRITE_TARGET, "SpecjaxCacheWrite"), (SWIGLU_TARGET, "SpecjaxSwiglu"),
            (GREEDY_TOKEN_TARGET, "SpecjaxGreedyToken"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")

log = logging.getLogger(__name__)


def cache_dir() -> str:
    """kernels/ under the user cache (specjax.settings.cache_dir)."""
    return os.path.join(settings.cache_dir(), "kernels")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    """The C++ compiler: $CXX, else the first of g++, c++, clang++ on PATH (None: none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def library_path(cxx: str) -> str:
    sources = []
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            sources.append(f.read())
    key = hashlib.sha256(b"\0".join([*sources, jaxlib.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode(), cpu_flags().encode()])).hexdigest()[:16]
    return os.path.join(cache_dir(), f"cpu_kernels-{key}.so")


def build(cxx: str, out: str) -> None:
    """Compile to a temporary file and move it into place (concurrent builders each write their own)."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-I", ROOT, *SOURCES, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def load() -> str | None:
    """Build (once per machine) and register the kernels (the small-M matmul over float32, Q4_1, Q8_0, and Q4_1 and
    Q8_0 times 8-bit activations; verify attention; rotary embedding (also of a fused projection's q, k, v); RMS
    norm; the KV cache write; SwiGLU; the greedy token); the float32 matmul's FFI target name, or None where they
    cannot be built."""
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: the CPU kernels are off, XLA computes their products")
        return None
    path = library_path(cxx)
    try:
        if not os.path.exists(path):
            build(cxx, path)
        lib = ctypes.cdll.LoadLibrary(path)
    except (RuntimeError, OSError) as e:
        log.warning("the CPU kernels are off, XLA computes their products: %s", e)
        return None
    for target, symbol in HANDLERS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return TARGET


def require() -> str:
    """load(), or a clear error where the kernels could not be built (a kernel called directly needs them)."""
    target = load()
    if target is None:
        raise RuntimeError("the CPU kernels could not be built on this machine (see the log)")
    return target


def available() -> bool:
    """Whether the kernels are built and registered on this machine (building them on first use)."""
    return load() is not None
