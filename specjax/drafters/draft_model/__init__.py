"""A separate small Llama-family LM with its own KV cache proposes k tokens, one sequential step each (or a tree of
them, one draft forward per depth).

A draft model is a Model (an HF directory: its own embedding and vocabulary), or, for a target whose vocabulary makes
an own embedding too large to ship (SmolLM2-135M's 49152 x 576 table is a fifth of it), a TargetEmbeddingDraft: a
specjax drafter artifact (kind "draft_model") of decoder layers of the target's width that embed tokens with the
TARGET's embedding (target_weights), a final norm, and an LM head over a draft vocabulary of N frequent target
tokens (d2t, specjax.drafters.draft_vocab; drafts and their q live over the target's vocabulary, every other token
at probability 0, so speculative sampling stays exact) or, without one, the target's own output head.
init_from_target makes one from the target's first layers (train.draft --init_layers distills it).

The package, one module per job: config (KIND, TargetEmbeddingDraft, init_from_target), model (forward_params, the
params a draft reading the target's embedding runs with, which the drafter and the training losses share), drafter
(DraftModelDrafter and its registration as "draft_model"; the cache bookkeeping and trees; prepare_llama_params and
llama_param_specs, a Llama draft's layout, PARD's too), checkpoint (a TargetEmbeddingDraft in and out and checked
against its target: save, load, check_target, and the tensors' names and shapes target_embedding_shapes /
target_embedding_params, PARD's too; a Model draft's vocabulary against the target's: check_same_vocabulary).
"""
from specjax.drafters.draft_model.checkpoint import (check_same_vocabulary, check_target, load, save,
                                                     target_embedding_params, target_embedding_shapes)
from specjax.drafters.draft_model.config import KIND, TargetEmbeddingDraft, init_from_target
from specjax.drafters.draft_model.drafter import (DraftModelDrafter, llama_param_specs,   # registers "draft_model"
                                                  prepare_llama_params)
from specjax.drafters.draft_model.model import forward_params

__all__ = ["KIND", "DraftModelDrafter", "TargetEmbeddingDraft", "check_same_vocabulary", "check_target",
           "forward_params", "init_from_target", "llama_param_specs", "load", "prepare_llama_params", "save",
           "target_embedding_params", "target_embedding_shapes"]
