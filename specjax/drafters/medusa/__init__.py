"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head i (0-based) reads the target's final normed hidden state at the position that produced the bonus token and
predicts the token i + 1 places after the bonus: ResBlocks `x + SiLU(x W + b)`, then a vocabulary projection.
A proposal costs K small matmuls and no target forward, which is the point: the drafts come from features the
verify pass already computed.

Projections ("layout" in the artifact's config):
  per_head  each head has its own [H, V] LM head (the paper's; K separate vocabulary matmuls per step)
  shared    the heads output hidden states that go through ONE [H, V] projection (one K-row matmul that reads
            the weights once; a K-th of the storage)
  target_head  as shared, through the target's own LM head (frozen; read through the target-weights contract, so
            the artifact holds only the ResBlocks: what a target with a large vocabulary ships)

Proposals: a chain (head i's argmax; at temperature > 0 a sample from head i's distribution after the shared
sampling transform, q = that distribution, which speculative sampling verifies exactly), a static tree from
the heads' top candidates per depth (tree_choices: e.g. trees.MEDUSA_63, or trees.choices_from_accuracies
built from measured per-head top-k accuracies), or a dynamic tree whose paths are ranked by the sum of their
heads' log-probabilities (num_steps / topk / num_draft_tokens; tree_search.tree_from_position_logits, as for the
block drafters); tree children are deterministic top-k, exact at any temperature.
Medusa's typical acceptance is the lossy SpecConfig(acceptance_method="typical_lossy").

The package, one module per job: config (MedusaHeads, LAYOUTS, init_heads), model (the heads' maths the drafter and
the training losses share: head_hidden, head_logits), drafter (MedusaDrafter, first_heads and its registration as
"medusa"), checkpoint (ours and the published layouts, in and out: save_heads, load_heads, load_published; the
MANIFEST's per-rank accuracies and the tree they give: rank_accuracy, accuracy_tree).
"""
from specjax.drafters.medusa.checkpoint import accuracy_tree, load_heads, load_published, rank_accuracy, save_heads
from specjax.drafters.medusa.config import KIND, LAYOUTS, MedusaHeads, init_heads
from specjax.drafters.medusa.drafter import MedusaDrafter, first_heads       # registers "medusa"
from specjax.drafters.medusa.model import head_hidden, head_logits

__all__ = ["KIND", "LAYOUTS", "MedusaDrafter", "MedusaHeads", "accuracy_tree", "first_heads", "head_hidden",
           "head_logits", "init_heads", "load_heads", "load_published", "rank_accuracy", "save_heads"]
