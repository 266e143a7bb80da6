"""EAGLE drafters (Li et al. 2024/2025): one decoder layer that autoregresses over the target's FEATURES.

Two methods, one drafter class:
  "eagle"   EAGLE-1 / EAGLE-2. Input at sequence entry t: fc(concat(embed(x_{t+1}), f_t)) (2H -> H, with bias),
            f_t = the target's final NORMED hidden state at position t (target_out.hidden); one Llama decoder layer
            WITHOUT an input norm (as the reference's layer 0: attention reads the fc output, then
            post_attention_layernorm + SwiGLU MLP); the TARGET's LM head on the layer output, no final norm (the
            drafter regresses the target's normed feature f_{t+1}). Embedding and LM head: the target's
            (target_weights = ("embed", "lm_head"); a published checkpoint's own embed_tokens is used when present).
            Chains, static trees (tree_choices) and EAGLE-2 dynamic trees (num_steps / topk / num_draft_tokens).
  "eagle3"  EAGLE-3. The feature is fused from several target layers (`target_layers`, decoder-layer indices whose
            OUTPUTS are read, usually three: low, middle, high): g_t = fc(concat(l_a, l_b, l_c)) (n*H_t -> H, no
            bias). The decoder layer's attention reads concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))
            (q/k/v input width 2H); the residual is g_t (hidden_norm(g_t) with norm_before_residual, a speculators
            option); post_attention_layernorm + MLP; then its own final `norm` and `lm_head` over a reduced draft
            vocabulary of N tokens: draft id i is target id i + d2t[i]. Drafts are mapped to target ids; at
            temperature > 0 the draft distribution q is over the TARGET vocabulary (zero outside the draft vocab:
            the draft logits are scattered into a [V] row of -1e30 before the shared sampling transform), so
            speculative sampling stays exact. At draft step i > 0 the layer consumes its own previous output
            (pre-norm) as the hidden input, exactly as EAGLE-1 does.
            P-EAGLE (config.parallel_drafting; Hui et al. 2026): draft 1 as above, drafts 2..k from ONE forward of
            k - 1 entries whose inputs are a learned mask embedding and shared hidden state (they stand for the
            drafts not yet known); trees are built from those per-depth distributions.

The package, one module per job: config (EagleConfig, EagleWeights, eagle_config, init_params, the target
layers an EAGLE-3 drafter fuses), vocab (EAGLE-3's draft vocabulary maps), model (the layer maths and the training
forwards), drafter (EagleDrafter and its registration as "eagle" and "eagle3"), checkpoint (our artifacts and the
published layouts, in and out).

Training (pure functions, no cache): forward_sequence, ttt_forward (attending as ttt_mask specifies; P-EAGLE:
mask_inputs at the steps past the first), project_features, draft_logits,
init_params, eagle_config, the vocabulary helpers (vocab_map_from_counts, t2d_from_d2t, target_to_draft).
"""
from specjax.drafters.eagle.checkpoint import (VOCAB_MAP_NAME, check_target, export_published, load, load_published,
                                               save)
from specjax.drafters.eagle.config import (KINDS, EagleConfig, EagleWeights, default_target_layers, eagle_config,
                                           init_params, reference_target_layers)
from specjax.drafters.draft_vocab import NEG_LOGIT
from specjax.drafters.eagle.drafter import EagleDrafter, EagleState   # registers "eagle", "eagle3"
from specjax.drafters.eagle.model import (draft_logits, forward_sequence, mask_inputs, project_features, ttt_forward,
                                          ttt_mask)
from specjax.drafters.eagle.vocab import (check_vocab_map, draft_to_target, restrict_draft_vocab, t2d_from_d2t,
                                          target_to_draft, vocab_map_from_counts)

__all__ = ["KINDS", "NEG_LOGIT", "VOCAB_MAP_NAME", "EagleConfig", "EagleDrafter", "EagleState", "EagleWeights",
           "check_target", "check_vocab_map", "default_target_layers", "draft_logits", "draft_to_target",
           "eagle_config", "export_published", "forward_sequence", "init_params", "load", "load_published", "mask_inputs",
           "project_features", "reference_target_layers", "restrict_draft_vocab", "save", "t2d_from_d2t",
           "target_to_draft", "ttt_forward", "ttt_mask", "vocab_map_from_counts"]
