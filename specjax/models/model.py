"""Model (a loaded target or draft model: config, params, tokenizer) and load_model()."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import checkpoints
from specjax.models.config import ModelConfig
from specjax.models.gguf_io import convert_gguf
from specjax.models.hf_io import load_chat_template, load_pretrained, save_pretrained
from specjax.models.llama import full_logits


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict
    tokenizer: Any = None           # tokenizers.Tokenizer or None
    name: str = ""
    chat_template: str | None = None   # jinja2 source (tokenizer_config.json or GGUF metadata), None: no chat

    def logits(self, tokens) -> jax.Array:
        """Full forward, no cache: int32 [B, T] -> float32 [B, T, V]."""
        return _full_logits(self.params, self.config, jnp.asarray(tokens, jnp.int32))

    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids (the model's own tokenizer)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer; pass token-id lists instead of strings")
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> text ("" without a tokenizer)."""
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

    def save_pretrained(self, path: str | os.PathLike, dtype: str = "float32",
                        max_shard_bytes: int | None = None) -> None:
        """An HF directory that transformers and vLLM load: weights, config, tokenizer and chat template."""
        save_pretrained(self.params, self.config, path, tokenizer=self.tokenizer, dtype=dtype,
                        max_shard_bytes=max_shard_bytes, chat_template=self.chat_template)


_full_logits = jax.jit(full_logits, static_argnums=1)


def model_directory(path_or_name: str | os.PathLike) -> str:
    """The HF directory load_model reads for a directory, shipped name, GGUF file or installed GGUF target (a GGUF
    file converted once into the user cache): what another engine (transformers, vLLM) loads for the same
    weights."""
    return _directory(checkpoints.resolve(path_or_name, "model"))


def _directory(found: str) -> str:
    """A resolved checkpoint (a directory, or a GGUF file) -> the HF directory to read."""
    return convert_gguf(found, checkpoints.cache_dir()) if os.path.isfile(found) else found


def load_model(path_or_name: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None) -> Model:
    """A Hugging Face Llama/Qwen2/Mistral directory, a llama.cpp GGUF file, or the name of a shipped model or an
    installed GGUF target such as "smollm2-135m" (specjax.checkpoints). A GGUF file is converted once to a float32
    HF directory in the user cache (specjax.checkpoints.cache_dir) and loaded from there.
    mesh: load each tensor straight into its tensor-parallel layout on that mesh (specjax.sharding.make_mesh);
    the model must split evenly over its "model" axis (a small draft model need not: load it without the mesh
    and generate(mesh=...) places it, dims the axis does not divide replicated)."""
    found = checkpoints.resolve(path_or_name, "model")
    path = _directory(found)
    name = os.path.basename(os.path.normpath(found))
    if os.path.isfile(found):                                  # a GGUF file: named as asked, or by its stem
        name = os.fspath(path_or_name) if not os.path.exists(os.fspath(path_or_name)) else name[:-len(".gguf")]
    kind = checkpoints.artifact_kind(path)
    if kind is not None:
        raise ValueError(f"{os.fspath(path_or_name)!r} is a {kind!r} drafter artifact, not a model: pass it as "
                         f"generate(..., SpecConfig(method={kind!r}), drafter={os.fspath(path_or_name)!r})")
    params, cfg, tokenizer = load_pretrained(path, dtype=dtype, mesh=mesh)
    return Model(cfg, params, tokenizer, name, load_chat_template(path))
