"""CPU kernels for specjax: C++ through XLA FFI, compiled on first use, each registered as the "cpu_kernel" backend
of one op of specjax.ops (whose definition it matches). Importing this package registers them all; specjax imports
it as a plugin (specjax.ops.backends.PLUGINS) when it is installed, and runs every op on XLA when it is not.
See README.md here for what each kernel is for and how it was measured."""
from cpu_kernels import (cache_write, greedy_token, rms_norm, rope, small_m_matmul, swiglu,  # noqa: F401
                         verify_attention)
