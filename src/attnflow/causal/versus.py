"""Does attention rollout follow the interventions? Each method's per-layer prediction of where the
answer lives in the residual stream, against exact activation patching of that stream.

Exact side: the denoising sweep of `attnflow.causal.api.patch` over the residual sites, ``effects
[L + 1, token]`` (row 0: the stream entering the first layer, row l + 1: leaving layer l; 1 = that
one site of the clean run restores the answer in the corrupted run). Prediction side, from the
registered methods run on the clean text (no method is recomputed here), read at the model's
saliency row (``model.default_row``: the CLS row, the mean of the rows, or the last position):

- ``rollout``: rollout of layers 0 … l (its ``layerwise`` output) for row l + 1: how much of the
  stream at (l, i) each input token makes up, read at the predicting row;
- ``rollout_above``: rollout of layers l + 1 … L − 1 (its ``start_layer`` option; row L, with no
  layer above, is the identity): how much the output draws on the stream at (l, j), which is what
  restoring (l, j) tests;
- ``flow``: attention flow through layers 0 … l (its ``layer`` option);
- ``grad_rollout``, ``attnlrp``, ``gim``: one score per token (the whole model), the same at every
  layer;
- ``routes``: information flow routes (`attnflow.flow_routes.api.prediction_importance`): for row r,
  the importance of the node ``("in", r, j)`` — the stream entering layer r, which is the stream
  leaving layer r − 1, the very stream the sweep's row r restores — for the prediction at the
  saliency row (a mean-pooling head: the pooled vector, the mean of the last layer's nodes),
  through the route at the default threshold. Row L (leaving the last layer) is the top itself:
  1 at the predicting position, 0 elsewhere (a mean-pooled head: the top's weights);
- ``routes_counterfactual``: ``routes`` with the counterfactual, each node's importance times the
  share of it the corruption changes, ‖x − x̃‖ / ‖x‖ (`prediction_importance`'s ``corrupt``):
  what the prediction reads *and* what differs between the runs, which is what patching restores.

Row 0 (the embeddings) has no composed layer: ``rollout`` and ``flow`` are NaN there. The Spearman
correlation over positions, per layer and prompt, is NaN where either side is constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from attnflow.causal.labels import layer_label
from attnflow.errors import InputError
from attnflow.methods.agreement import spearman
from attnflow.model_like import ModelLike
from attnflow.targets import Target, legacy_target

VERSUS_METHODS = (
    "rollout",
    "rollout_above",
    "flow",
    "grad_rollout",
    "attnlrp",
    "gim",
    "routes",
    "routes_counterfactual",
)
_OWN_PASS = ("routes", "routes_counterfactual")  # not registered methods: their own forward passes
# The registered method each prediction runs (``rollout_above`` is rollout with a start layer).
_REGISTERED = {"rollout_above": "rollout"}


@dataclass
class LayerComparison:
    """One prompt: exact residual effects and each method's prediction, both ``[L + 1, token]``."""

    clean_text: str
    corrupt_text: str
    tokens: list[str]
    row: Any
    effects: np.ndarray
    predictions: dict[str, np.ndarray]

    def spearman(self, skip_first: bool = False) -> dict[str, np.ndarray]:
        """``{method: [L + 1]}`` Spearman ρ over positions between prediction and effect, per
        residual row (NaN where either is constant or undefined); ``skip_first`` leaves out the
        first position (the attention sink of most models)."""
        start = 1 if skip_first else 0
        return {
            method: np.array(
                [_spearman(predicted[layer, start:], self.effects[layer, start:]) for layer in range(len(self.effects))]
            )
            for method, predicted in self.predictions.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """Every number, JSON-ready."""
        return {
            "clean_text": self.clean_text,
            "corrupt_text": self.corrupt_text,
            "tokens": self.tokens,
            "row": self.row,
            "effects": self.effects.tolist(),
            "predictions": {method: values.tolist() for method, values in self.predictions.items()},
        }


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """`attnflow.methods.agreement.spearman`, NaN where either side is not finite."""
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return spearman(a, b)


def parse_versus_methods(methods: str | Sequence[str]) -> tuple[str, ...]:
    """``"rollout,flow"`` or a sequence -> known prediction methods (`VERSUS_METHODS`), in order."""
    names = [name.strip() for name in (methods.split(",") if isinstance(methods, str) else methods) if name.strip()]
    unknown = [name for name in names if name not in VERSUS_METHODS]
    if unknown or not names:
        raise InputError(
            f"unknown method(s) {', '.join(unknown) or '(none)'} to compare with patching; "
            f"choose from {', '.join(VERSUS_METHODS)}"
        )
    return tuple(dict.fromkeys(names))


def compare_with_patching(
    model: ModelLike,
    clean: str,
    corrupt: str,
    *,
    target: Target | int | str | None = None,
    contrast: int | str | None = None,
    methods: str | Sequence[str] = VERSUS_METHODS,
    batch_size: int = 32,
    progress: bool = False,
) -> LayerComparison:
    """Exact residual patching (denoising) of ``clean``/``corrupt`` and every method's per-layer
    prediction on ``clean`` (module docstring). ``target`` (a `attnflow.targets.Target`, or a class
    or token for short) defines the patching metric as in `attnflow.patch`, its contrast included;
    the target-dependent methods explain its class or token (default: the clean prediction).
    ``contrast``: deprecated, the contrast inside the ``target``."""
    from attnflow.causal.api import patch

    wanted = legacy_target(target, None, contrast, "compare_with_patching")
    chosen = parse_versus_methods(methods)
    result = patch(
        model,
        clean,
        corrupt,
        target=wanted,
        sites="residual",
        methods="exact",
        batch_size=batch_size,
        progress=progress,
    )
    effects = np.asarray(result.effects["exact"]["residual"], dtype=np.float64)  # [L + 1, token]
    predictions = layer_predictions(model, clean, chosen, target=wanted.label, corrupt=corrupt)
    return LayerComparison(clean, corrupt, result.tokens, model.default_row, effects, predictions)


def layer_predictions(
    model: ModelLike,
    text: str,
    methods: Sequence[str],
    *,
    target: int | str | None = None,
    corrupt: str | None = None,
) -> dict[str, np.ndarray]:
    """``{method: [L + 1, token]}`` each method's prediction for every residual row (module
    docstring), read at ``model.default_row``; ``corrupt``: the counterfactual text
    ``routes_counterfactual`` reads (needed for it alone)."""
    from attnflow.methods.extras import split
    from attnflow.methods.registry import call_method, get_method
    from attnflow.methods.saliency import saliency_row

    predictions: dict[str, np.ndarray] = {}
    if "routes" in methods:  # not a registered method: its own forward pass
        from attnflow.flow_routes.api import prediction_importance

        predictions["routes"] = prediction_importance(model, text, model.default_row)
    if "routes_counterfactual" in methods:
        from attnflow.flow_routes.api import prediction_importance

        if corrupt is None:
            raise InputError(
                "routes_counterfactual compares the clean text with a corrupt one: give {corrupt}",
                parameter="corrupt",
            )
        predictions["routes_counterfactual"] = prediction_importance(model, text, model.default_row, corrupt=corrupt)
    specs = {method: get_method(_REGISTERED.get(method, method)) for method in methods if method not in _OWN_PASS}
    if not specs:
        return {method: predictions[method] for method in methods}
    uses_target = any(spec.uses_target for spec in specs.values())
    (trace,) = model.trace_for(
        sorted({spec.name for spec in specs.values()}), [text], target=target if uses_target else None
    )
    n_layers, n_tokens, row = model.n_layers, trace.n_tokens, model.default_row
    for method, spec in specs.items():
        rows = np.full((n_layers + 1, n_tokens), np.nan)  # [L + 1, token]
        if method == "rollout":
            composed = call_method(spec, trace, model, layerwise=True)  # [layer, query, key], R⁽⁰⁾ … R⁽ᴸ⁻¹⁾
            rows[1:] = saliency_row(composed, row)
        elif method == "rollout_above":
            for layer in range(n_layers - 1):
                rows[layer + 1] = saliency_row(call_method(spec, trace, model, start_layer=layer + 1), row)
            rows[0] = saliency_row(call_method(spec, trace, model), row)
            rows[n_layers] = saliency_row(np.eye(n_tokens), row)  # no layer above the last: the identity
        elif method == "flow":
            for layer in range(1, n_layers + 1):
                rows[layer] = saliency_row(call_method(spec, trace, model, layer=layer), row)
        else:
            scores, _ = split(call_method(spec, trace, model))
            scores = np.asarray(scores, dtype=np.float64)
            rows[:] = scores if scores.ndim == 1 else saliency_row(scores, row)
        predictions[method] = rows
    return {method: predictions[method] for method in methods}


def spearman_table(comparisons: Sequence[LayerComparison], skip_first: bool = False) -> dict[str, dict[str, Any]]:
    """``{method: {"mean": [L + 1], "se": [L + 1], "n": [L + 1]}}``: per residual row, the mean
    Spearman ρ over prompts, its standard error (sample std / √n) and the number of prompts where
    it is defined."""
    if not comparisons:
        raise InputError("no prompt pairs to compare")
    per_prompt = [comparison.spearman(skip_first) for comparison in comparisons]
    table: dict[str, dict[str, Any]] = {}
    for method in per_prompt[0]:
        values = np.stack([rhos[method] for rhos in per_prompt])  # [prompt, L + 1]
        counts = np.isfinite(values).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.nansum(values, axis=0) / counts
            spread = np.sqrt(np.nansum((values - mean) ** 2, axis=0) / (counts - 1))
        se = np.where(counts > 1, spread / np.sqrt(np.maximum(counts, 1)), np.nan)
        table[method] = {"mean": mean, "se": se, "n": counts}
    return table


def format_table(table: dict[str, dict[str, Any]]) -> str:
    """A Markdown table: one row per residual row (``emb`` = the stream entering the first layer,
    ``Ln`` = leaving layer n), one column per method, cells "mean ± s.e." ("–": undefined)."""
    methods = list(table)
    n_rows = len(table[methods[0]]["mean"])
    lines = ["| residual | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for row in range(n_rows):
        cells = []
        for method in methods:
            mean, se = table[method]["mean"][row], table[method]["se"][row]
            cells.append(
                "–" if not np.isfinite(mean) else f"{mean:+.2f} ± {se:.2f}" if np.isfinite(se) else f"{mean:+.2f}"
            )
        lines.append("| " + " | ".join([layer_label("residual", row), *cells]) + " |")
    return "\n".join(lines)
