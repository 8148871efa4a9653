"""Methods that re-run the model: leave-one-out, value zeroing, integrated gradients (captum), LRP.

They are registered like every other method (``needs`` holds ``"model"``) and called as
``method(model, trace, **options)`` by `AttentionModel.explain`; they reuse the capture's hooks
and `attnflow.targets.Objective` instead of re-implementing them.
"""

from attnflow.perturb.lrp import attnlrp, cp_lrp, lrp_relevance
from attnflow.perturb.methods import integrated_gradients, leave_one_out, value_zeroing

__all__ = ["attnlrp", "cp_lrp", "integrated_gradients", "leave_one_out", "lrp_relevance", "value_zeroing"]
