"""Benchmarks for the Pallas kernels (run as modules: python -m pallas_kernels.bench.<name>)."""
