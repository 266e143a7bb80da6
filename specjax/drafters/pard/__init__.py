"""PARD (parallel drafting): a small LM that fills k draft positions in ONE forward from mask placeholders.

The draft is an ordinary Llama whose vocabulary is the target's V tokens plus m reserved mask tokens appended after
them (ids V .. V + m - 1, special tokens of its tokenizer, listed in config.json as `pard_mask_token_ids`). One
proposal is one draft forward over

    [committed tokens not yet in the draft cache, as a fixed-width block of k + 1] + [mask_1 .. mask_{k-1}]

with the masks at the k - 1 positions after the last committed token, attending causally (the committed context
and earlier masks). The output at the last committed token is draft 1 (ordinary next-token prediction); the output
at mask j is draft j + 1. Logits are cut to the target's V before argmax / sampling, so a mask token is never
proposed; sampled drafts are drawn independently per position through specjax.sampling.probabilities and returned
with their distributions q, which keeps chain speculative sampling exact (draft j + 1 does not depend on draft j,
so its q is its marginal).

A draft for a target with a large vocabulary and no small sibling (SmolLM2-135M: its 49152 x 576 embedding is a
fifth of the model) reads the target's token embedding instead of holding its own (TargetEmbeddingPard): it stores
its decoder layers (hidden = the target's), the final norm, one embedding row per mask, and either nothing more
(drafts through the target's LM head) or an own head over a draft vocabulary of N frequent target tokens
(specjax.drafters.draft_vocab; every other token at probability 0, so speculative sampling stays exact).

The package, one module per job: config (PardModel, TargetEmbeddingPard and how they are made: add_mask_rows,
mask_tokenizer, init_target_embedding), model (embed_tokens, the input embeddings the drafter and the training loss
share), drafter (PardDrafter and its registration as "pard"; the cache under partial acceptance), checkpoint (both
kinds of draft in and out, and their checks against a target: save / load / check, save_target_embedding /
load_target_embedding / check_target_embedding).
"""
from specjax.drafters.pard.checkpoint import (check, check_target_embedding, load, load_target_embedding, save,
                                              save_target_embedding)
from specjax.drafters.pard.config import (CONFIG_KEY, KIND, MASK_TOKEN, PardModel, TargetEmbeddingPard, add_mask_rows,
                                          init_target_embedding, mask_tokenizer)
from specjax.drafters.pard.drafter import PardDrafter       # registers "pard"
from specjax.drafters.pard.model import embed_tokens

__all__ = ["CONFIG_KEY", "KIND", "MASK_TOKEN", "PardDrafter", "PardModel", "TargetEmbeddingPard", "add_mask_rows",
           "check", "check_target_embedding", "embed_tokens", "init_target_embedding", "load",
           "load_target_embedding", "mask_tokenizer", "save", "save_target_embedding"]
