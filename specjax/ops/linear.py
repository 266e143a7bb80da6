"""The linear op: x [..., K] @ w over a weight of any format.

w is a float32 array [K, N] (transposed=True: [N, K], read as w.T, e.g. a tied LM head's embedding [V, H]) or one
of the weight formats of specjax.models.weights, each of which defines its own product (`w.product(x,
transposed)`). The definition below is what every backend matches (cpu_kernels registers the small-M CPU kernel
over float32 matrices and every format); on accelerators XLA's dot computes it.
"""
from __future__ import annotations

import jax

from specjax.ops import backends

__all__ = ["linear", "linear_reference"]


def linear_reference(x: jax.Array, w, transposed: bool = False) -> jax.Array:
    """The definition: x @ w (transposed: x @ w.T) for a float32 array; a weight format's own product otherwise."""
    product = getattr(w, "product", None)
    if product is not None:
        return product(x, transposed)
    return x @ (w.T if transposed else w)


def linear(x: jax.Array, w, transposed: bool = False) -> jax.Array:
    """x [..., K] @ w -> [..., N], by the backend in force for "linear" (specjax.settings)."""
    check = getattr(w, "check_product", None)
    if check is not None:                     # a format read the other way round: a clear error, whatever backend
        check(transposed)
    return backends.call("linear", linear_reference, x, w, transposed=bool(transposed))
