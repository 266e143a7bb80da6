"""Drafters: one module per method, each registering itself with specjax.drafters.registry."""
from specjax.drafters.base import Context, Draft, Drafter, NullDrafter, Verified
from specjax.drafters.registry import BuildRequest, DrafterSpec, Option, register

__all__ = ["BuildRequest", "Context", "Draft", "Drafter", "DrafterSpec", "NullDrafter", "Option", "Verified",
           "register"]
