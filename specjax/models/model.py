"""Model (a loaded target or draft model: config, params, tokenizer) and load_model()."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax import checkpoints, ops
from specjax.models.config import ModelConfig
from specjax.models.weights import PanelMatrix, Q4_1Int8Matrix, Q4_1Matrix, Q8_0Int8Matrix, Q8_0Matrix
from specjax.models.gguf_io import convert_gguf, gguf_blocks
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
        params = from_panels(self.params, self.config)
        if "embed_blocks" in params or any("wqkv" in lp for lp in params["layers"]):
            raise ValueError(f"model {self.name!r} holds GGUF blocks (load_model(weight_format='gguf')); load it "
                             f"with weight_format='float32' to save an HF directory")
        save_pretrained(params, self.config, path, tokenizer=self.tokenizer, dtype=dtype,
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


WEIGHT_FORMATS = ("auto", "float32", "panels", "gguf", "gguf_int8")


def load_model(path_or_name: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None,
               weight_format: str = "auto") -> Model:
    """A Hugging Face Llama/Qwen2/Mistral directory, a llama.cpp GGUF file, or the name of a shipped model or an
    installed GGUF target such as "smollm2-135m" (specjax.checkpoints). A GGUF file is converted once to a float32
    HF directory in the user cache (specjax.checkpoints.cache_dir) and loaded from there.
    mesh: load each tensor straight into its tensor-parallel layout on that mesh (specjax.sharding.make_mesh);
    the model must split evenly over its "model" axis (a small draft model need not: load it without the mesh
    and generate(mesh=...) places it, dims the axis does not divide replicated).
    weight_format: "auto" (the default): "panels" where the CPU kernel computes the products (a CPU backend, the
    kernels built and on, float32, no mesh), else "float32". "float32": row-major arrays. "panels": the same
    values, each decoder-layer matrix rearranged for the CPU kernel (specjax.models.weights.PanelMatrix: each
    half of its rows in 16-column panels, so that a core streams one contiguous block where a row-major matrix puts
    a strip's rows a page apart) and q/k/v and gate/up fused into one product each: the float32 model's hidden states
    bit for bit wherever the kernel computes them (up to 1024 rows a call: a training batch runs XLA's dot over the
    fused matrices, float32 rounding apart); a tied LM head also gets panels of its own (head_panels: embed.T, a
    second copy of the embedding, which stays for lookups), summed in the layers' order rather than the row-major
    head's, so the logits equal the float32 model's up to float32 rounding. Any model, float32, no mesh;
    generate(mesh=...) and save_pretrained read the panels back row-major. Or "gguf" for a GGUF file whose
    decoder-layer matrices are Q4_1 (SmolLM2's): those matrices stay in the file's blocks (0.75 bytes per weight
    instead of 4), q/k/v and gate/up fused, and a Q8_0 tied embedding also serves as the LM head in its blocks
    (1.125 bytes; the float32 embedding stays for lookups).
    The CPU kernel reads them. The model computes exactly what the float32 one does (the blocks hold the same
    values, checked at load, and the kernel sums them in the float32 kernel's order); on a CPU a decode step reads
    a third of the bytes. Inference only (no gradient through the blocks), float32, no mesh.
    "gguf_int8": the same blocks in llama.cpp's own arithmetic for them (each row of a layer's input quantized to
    8 bits per block of 32, integer dot products; a Q8_0 LM head the same way): about a quarter of the float32 work per
    weight, so a verify pass of several positions costs less, but NOT the float32 model's function (lossy against
    it, as llama.cpp is; experiments.weight_format_shift measures how far). Greedy speculative decoding on it equals
    its own plain decoding (on a CPU every row of the forward is computed alike in a verify pass and a one-position
    step), not the float32 model's. A lossy, labeled mode."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: one of {WEIGHT_FORMATS}")
    found = checkpoints.resolve(path_or_name, "model")
    if weight_format == "auto":
        weight_format = "panels" if mesh is None and jnp.dtype(dtype) == jnp.float32 and panels_apply() else "float32"
    if weight_format != "float32":
        if weight_format.startswith("gguf") and not os.path.isfile(found):
            raise ValueError(f"weight_format={weight_format!r} needs a GGUF model; {os.fspath(path_or_name)!r} is an "
                             f"HF directory")
        if jnp.dtype(dtype) != jnp.float32 or mesh is not None:
            raise ValueError(f"weight_format={weight_format!r} loads float32 weights on one device (no dtype, no "
                             f"mesh)")
    path = _directory(found)
    name = os.path.basename(os.path.normpath(found))
    if os.path.isfile(found):                                  # a GGUF file: named as asked, or by its stem
        name = os.fspath(path_or_name) if not os.path.exists(os.fspath(path_or_name)) else name[:-len(".gguf")]
    kind = checkpoints.artifact_kind(path)
    if kind is not None:
        raise ValueError(f"{os.fspath(path_or_name)!r} is a {kind!r} drafter artifact, not a model: pass it as "
                         f"generate(..., SpecConfig(method={kind!r}), drafter={os.fspath(path_or_name)!r})")
    params, cfg, tokenizer = load_pretrained(path, dtype=dtype, mesh=mesh)
    if weight_format == "panels":
        params = to_panels(params)
    elif weight_format != "float32":
        params = _with_gguf_blocks(params, cfg, found, int8=weight_format == "gguf_int8")
    return Model(cfg, params, tokenizer, name, load_chat_template(path))


def panels_apply() -> bool:
    """Whether the CPU kernel computes this process's products (what weight_format="auto" reads): the linear op's
    backend in force is cpu_kernels' on this platform (specjax.settings), and the kernels are built."""
    return ops.selects("linear", "cpu_kernel")


def to_panels(params: dict) -> dict:
    """A Llama-family model's float32 params with every decoder-layer matrix the kernel takes as a PanelMatrix, q/k/v
    and gate/up fused into wqkv and w_gate_up where all of theirs are (specjax.models.llama), and a tied LM head's
    own panels (head_panels, embed.T: the kernel over panels streams the head faster than over the embedding
    read transposed, and at 4-64 rows computes it in a fraction of the time); the rest (norms, biases, the
    embedding) unchanged: load_model(weight_format="panels") for a model already in memory."""
    takes = lambda w: w.shape[0] % 2 == 0 and w.shape[1] % 16 == 0
    layers = []
    for lp in params["layers"]:
        lp = dict(lp)
        for fused, keys in (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up"))):
            if all(takes(lp[k]) for k in keys):
                lp[fused] = PanelMatrix.concatenate([PanelMatrix.from_dense(lp.pop(k)) for k in keys])
        for key in ("wo", "w_down"):
            if takes(lp[key]):
                lp[key] = PanelMatrix.from_dense(lp[key])
        layers.append({k: PanelMatrix(jnp.asarray(w.panels)) if isinstance(w, PanelMatrix) else w
                       for k, w in lp.items()})
    out = {**params, "layers": layers}
    if "lm_head" not in params and "embed_blocks" not in params and takes(params["embed"].T):
        out["head_panels"] = PanelMatrix(jnp.asarray(PanelMatrix.from_dense(np.asarray(params["embed"]).T).panels))
    return out


def weight_arrays(params: dict) -> list:
    """Every weight array of a model's params once (what counts of its parameters and of the bytes a forward reads
    sum): a tied head's panels (head_panels) hold the embedding's values again and are left out."""
    return jax.tree_util.tree_leaves(_without_head_panels(params))


def _without_head_panels(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "head_panels"}


def from_panels(params: dict, cfg: ModelConfig) -> dict:
    """to_panels undone: every PanelMatrix back to its row-major array, wqkv and w_gate_up split into their
    matrices (numpy arrays), head_panels dropped (the embedding holds its values). Params without panels are
    returned as they are."""
    params = _without_head_panels(params)
    layers = params.get("layers")
    if not isinstance(layers, (list, tuple)) or not any(
            isinstance(w, PanelMatrix) for lp in layers if isinstance(lp, dict) for w in lp.values()):
        return params
    dense = lambda w: np.asarray(w.dequantize()) if isinstance(w, PanelMatrix) else w
    layers = []
    for lp in params["layers"]:
        lp = {k: dense(w) for k, w in lp.items()}
        if "wqkv" in lp:
            q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            lp["wq"], lp["wk"], lp["wv"] = np.split(lp.pop("wqkv"), [q_width, q_width + kv_width], axis=1)
        if "w_gate_up" in lp:
            lp["w_gate"], lp["w_up"] = np.split(lp.pop("w_gate_up"), 2, axis=1)
        layers.append(lp)
    return {**params, "layers": layers}


def _with_gguf_blocks(params: dict, cfg: ModelConfig, found: str, int8: bool = False) -> dict:
    """params with every decoder-layer matrix replaced by the file's Q4_1 blocks (q/k/v and gate/up fused into
    wqkv and w_gate_up, specjax.models.llama; int8: packed for 8-bit activations, Q4_1Int8Matrix) and, for a Q8_0
    tied embedding, "embed_blocks" for the LM head; each checked to hold exactly the float32 values loaded."""
    layer_blocks, embed_blocks = gguf_blocks(found, cfg)

    def same(w, dense, what):
        if not np.array_equal(np.asarray(w.dequantize()), np.asarray(dense)):
            raise ValueError(f"{found}: the blocks of {what} do not give the float32 weights loaded (a stale "
                             f"conversion in the cache?)")
    layers = []
    for i, (lp, bl) in enumerate(zip(params["layers"], layer_blocks)):
        for key, w in bl.items():
            same(w, lp[key], f"layer {i} {key}")
        fused = {"wqkv": Q4_1Matrix.concatenate([bl["wq"], bl["wk"], bl["wv"]]),
                 "w_gate_up": Q4_1Matrix.concatenate([bl["w_gate"], bl["w_up"]]), "wo": bl["wo"],
                 "w_down": bl["w_down"]}
        if int8:
            fused = {k: Q4_1Int8Matrix.from_q4_1(w) for k, w in fused.items()}
        norms = {k: v for k, v in lp.items() if k not in bl}
        layers.append({**norms, **{k: type(w)(*map(jnp.asarray, w)) for k, w in fused.items()}})
    out = {**params, "layers": layers}
    if embed_blocks is not None and "lm_head" not in params:
        same(embed_blocks, params["embed"], "token_embd")
        head = embed_blocks
        if int8:                     # rows padded to whole 16-row panels (zero logits, cut off by lm_head)
            pad = ((0, -embed_blocks.shape[0] % 16), (0, 0))
            head = Q8_0Int8Matrix.from_q8_0(Q8_0Matrix(*(np.pad(np.asarray(a), pad) for a in embed_blocks)))
        out["embed_blocks"] = type(head)(*map(jnp.asarray, head))
    return out
