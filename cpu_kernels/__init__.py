"""CPU kernels for specjax (XLA FFI custom calls compiled on first use). Each kernel sits beside its pure-jnp
reference and falls back to it where the kernel cannot run."""
