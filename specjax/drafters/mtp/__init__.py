"""Multi-token prediction drafters: decoder layers of their own that read the target's features.

Two methods, one layer (specjax.models.llama.decoder_layer, with a KV cache per module / head):

  "mtp"        DeepSeek-V3-style MTP modules on a frozen (or jointly trained) target. Module d (1..D) keeps the
               causal chain: its input at a position is proj([RMSNorm(h^{d-1}); RMSNorm(embed(next token))])
               (2H -> H, no bias), h^0 = the target's final normed hidden state, h^{d-1} = module d-1's output;
               one Llama decoder layer; its own final RMSNorm and the TARGET's LM head (and embedding:
               target_weights = ("embed", "lm_head")). A proposal is a chain: draft d comes from module d; beyond D
               the last module is reused on its own output (as vLLM runs DeepSeek's one module for k > 1).
  "mtp_heads"  Gloeckle et al. (2024) multi-token heads, used self-speculatively. The target was trained with n
               output heads on a shared trunk: head 1 is the target's own last decoder layer (it verifies), heads
               2..n are one decoder layer each over the trunk's output (`trunk_layer`, a target layer the loop
               exposes), each with its own final norm, through the target's LM head. Head i at position t predicts
               token t + i, so the trunk features that produced the bonus token give n - 1 drafts at the cost of
               n - 1 vocabulary projections (the heads' layers run over the verified positions at commit).

The package, one module per job: config (MTPConfig, MTPWeights, init_params), model (the layer maths, with the
cache-free forwards training uses: mtp_forward_sequence, heads_forward_sequence), drafter (MTPDrafter and its
registration as "mtp" and "mtp_heads"), checkpoint (artifacts of kinds "mtp" and "mtp_heads", specjax.drafters.
artifacts; a multi-token target's heads live in its directory under `mtp_heads/`).
"""
from specjax.drafters.mtp.checkpoint import HEADS_DIR, load, save
from specjax.drafters.mtp.drafter import MTPDrafter, MTPState       # registers "mtp" and "mtp_heads"
from specjax.drafters.mtp.config import KINDS, MTPConfig, MTPWeights, init_params, layer_config
from specjax.drafters.mtp.model import heads_forward_sequence, mtp_forward_sequence

__all__ = ["HEADS_DIR", "KINDS", "MTPConfig", "MTPDrafter", "MTPState", "MTPWeights", "heads_forward_sequence",
           "init_params", "layer_config", "load", "mtp_forward_sequence", "save"]
