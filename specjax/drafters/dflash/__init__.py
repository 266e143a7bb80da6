"""A DFlash-style block drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few
decoder layers fill a block of k mask positions after the last committed token in ONE forward, reading the target's
own features of every committed position as keys and values ("KV injection").

Per step, for a row whose last committed token x_L sits at position L:
  block   [embed(x_L), m, m, ..., m] at positions L .. L + k (m: the drafter's learned mask embedding; the anchor's
          embedding is the target's);
  context the target's features of positions 0 .. L - 1 (the outputs of config.target_layers, concatenated, through
          fc and a norm), as keys and values of every draft layer (each layer's own projections, cached);
  layers  pre-norm decoder layers whose queries are the block's; each block position attends to the whole context
          and to every block position (bidirectional inside the block); per-head norms on queries and keys;
  output  the final norm, then the target's LM head at block positions 1 .. k: one distribution per draft; or,
          with a draft vocabulary (config.draft_vocab_size = N), the drafter's own head over N frequent target
          tokens (EAGLE-3's reduction: the full head is the drafter's largest matmul), every other token at
          probability 0.
Draft i is drawn from its own position's distribution (greedy: its argmax), which does not depend on the other
drafts; speculative sampling accepts it exactly against the target at any temperature (q_i is what it was drawn
from). Trees (DDTree's idea, through the shared tree search): a static tree (tree_choices) whose depth-d nodes
hold block position d's top tokens by rank, or a dynamic tree (num_steps, topk, num_draft_tokens) searched
best-first over the positions' log-probabilities; deterministic top-k children, exact at any temperature; still
one drafter forward per step.

The package, one module per job: config (DFlashConfig, dflash_config, default_target_layers, init_params,
DFlashWeights), model (the block maths the drafter and the training loss share: context_features, context_kv,
block_inputs, block_forward, draft_logits), drafter (DFlashDrafter and its registration as "dflash"), checkpoint
(our artifacts in and out, save and load; the public DFlash layout in, load_published).
"""
from specjax.drafters.dflash.checkpoint import load, load_published, save
from specjax.drafters.dflash.config import (KIND, DFlashConfig, DFlashWeights, default_target_layers, dflash_config,
                                            init_params)
from specjax.drafters.dflash.drafter import DFlashDrafter       # registers "dflash"
from specjax.drafters.dflash.model import block_forward, block_inputs, context_features, context_kv, draft_logits

__all__ = ["KIND", "DFlashConfig", "DFlashDrafter", "DFlashWeights", "block_forward", "block_inputs",
           "context_features", "context_kv", "default_target_layers", "dflash_config", "draft_logits", "init_params",
           "load", "load_published", "save"]
