"""A draft model's maths beyond a Llama forward (specjax.models.llama.forward runs its layers), shared by the drafter
and the training losses (train.losses.common.DraftHead, train.losses.draft_model): the params a draft reading the
target's embedding runs with (forward_params: the target's embedding, and its output head where the draft has no
head of its own)."""
from __future__ import annotations


def forward_params(params: dict, target_weights: dict) -> dict:
    """A TargetEmbeddingDraft's params as llama.forward reads them: the target's embedding for the input and, without
    an own head over a draft vocabulary, the target's output head as the target stores it (a tied one read in
    place). target_weights: {"embed", "output_head"} as TARGET_WEIGHTS gives them (the drafter's ctx, or
    target_weight() of the target's params in training)."""
    head = {} if "lm_head" in params else target_weights["output_head"]
    return {**params, **head, "embed": target_weights["embed"]}        # a tied head's "embed" is the same table
