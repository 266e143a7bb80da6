from specjax.drafters.base import Context, Draft, Drafter, NullDrafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.predicted import PredictedDrafter

__all__ = ["Context", "Draft", "Drafter", "NullDrafter", "DraftModelDrafter", "NgramDrafter", "PredictedDrafter"]
