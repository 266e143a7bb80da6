"""Pallas kernels for specjax. Each kernel sits beside its pure-jnp reference."""
