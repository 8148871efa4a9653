"""Methods that re-run the model: leave-one-out, Shapley values (shap), value zeroing, integrated gradients
(captum), the backward-rule methods (cp_lrp, attnlrp, gim: the rule sets of `lrp.RULE_TABLE`, each a map
from module kinds to `Rule` objects).

They are registered like every other method (``needs`` holds ``"model"``; the registry's
`attnflow.methods.registry.CATALOGUE` names their modules) and called as
``method(model, trace, **options)`` by `AttentionModel.explain`; they reuse the capture's hooks
and `attnflow.targets.Objective` instead of re-implementing them. They are the one part of
`attnflow.methods` that may import the capture and the targets (inside their functions); the pure
functions on arrays beside them never do.
"""

from attnflow.methods.model.lrp import (
    RULE_TABLE,
    RULES,
    BackwardRules,
    ConstantNorm,
    Identity,
    Rule,
    Scale,
    TemperedSoftmax,
    lrp_relevance,
    register_rules,
    unregister_rules,
)
from attnflow.methods.model.perturbation import integrated_gradients, leave_one_out, shap, value_zeroing

__all__ = [
    "RULES",
    "RULE_TABLE",
    "BackwardRules",
    "ConstantNorm",
    "Identity",
    "Rule",
    "Scale",
    "TemperedSoftmax",
    "integrated_gradients",
    "leave_one_out",
    "lrp_relevance",
    "register_rules",
    "shap",
    "unregister_rules",
    "value_zeroing",
]
