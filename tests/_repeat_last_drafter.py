"""A new drafter, written as a user would write one: propose k copies of the last committed token. This file and
one FACTORIES line in tests/conformance_factories.py are everything it takes to run through generate(), the speedup
experiment (--drafter_modules=_repeat_last_drafter) and a mesh."""
import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import Draft, last_tokens
from specjax.drafters.registry import DrafterSpec, register


@dataclasses.dataclass(frozen=True)
class RepeatLastDrafter:
    k: int
    target_layers = ()                # target layers whose hidden states it needs (prefill and verify): none
    target_weights = ()               # target weights it reads ("embed", "lm_head", "final_norm"): none

    def init(self, params, ctx, target_out, sp):
        return ()

    def propose(self, params, state, ctx, keys, sp):
        return Draft(jnp.repeat(last_tokens(ctx, 1), self.k, axis=1)), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        return state


def _build(req):
    if req.drafter is not None:
        raise ValueError("method='repeat_last' takes no drafter")
    return RepeatLastDrafter(req.config.k), ()


register(DrafterSpec("repeat_last", _build), replace=True)    # replace: the module may be imported twice
