"""What a layer computes, defined once: each op's pure-jnp definition plus a table of backends that compute it
faster on some platform (cpu_kernels and pallas_kernels register theirs; specjax.settings chooses). The models call
these ops and never name a backend.

  linear(x, w, transposed)          x @ w over a float32 matrix or a weight format (specjax.models.weights)
  rms_norm(x, w, eps)
  rope(x, positions, inv_freq), rope_qkv(qkv, positions, inv_freq, num_heads, num_kv_heads)
  swiglu(gate_up)
  attention(q, k_cache, v_cache, lengths, mask, ...)   T new positions over a KV cache (decode, verify, tree)
  write_kv(k_buf, v_buf, k_new, v_new, starts, keys_transposed)
  greedy_token(logits)
"""
from specjax.ops.activation import swiglu, swiglu_reference
from specjax.ops.attention import attention, attention_reference, verify_attention_reference, visibility
from specjax.ops.backends import Backend, reference_gradient, register_backend, registered_backends, selects
from specjax.ops.cache_write import block_index, write_kv, write_kv_reference
from specjax.ops.greedy import greedy_token, greedy_token_reference
from specjax.ops.linear import linear, linear_reference
from specjax.ops.norm import rms_norm, rms_norm_reference
from specjax.ops.rope import rope, rope_qkv, rope_qkv_reference, rope_reference

__all__ = ["Backend", "attention", "attention_reference", "block_index", "greedy_token", "greedy_token_reference",
           "linear", "linear_reference", "reference_gradient", "register_backend",
           "registered_backends", "rms_norm", "rms_norm_reference", "rope", "rope_qkv", "rope_qkv_reference",
           "rope_reference", "selects", "swiglu", "swiglu_reference", "verify_attention_reference", "visibility",
           "write_kv", "write_kv_reference"]
