"""Pallas kernels for specjax (GPU: Triton; TPU: Mosaic; interpret mode on a CPU), each registered as a backend of
one op of specjax.ops; importing this package registers them (specjax imports it as a plugin when installed)."""
from pallas_kernels import verify_attention  # noqa: F401
