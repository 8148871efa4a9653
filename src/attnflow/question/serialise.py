"""``why.json``: what `attnflow.question.result.Why` holds, as JSON-ready Python objects (NaN as
null). Each score vector is the one its own command writes (explanation.json, routes.json,
patch.json), so the agreement can be recomputed from those files."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnflow.tokens import display_token


def plain(value: Any) -> Any:
    """``value`` with arrays as lists, NumPy scalars as Python numbers and NaN/inf as None."""
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def why_dict(found: Any) -> dict[str, Any]:
    """The content of ``why.json`` (docs/why.md)."""
    from attnflow.question.wording import answer_of

    return plain(
        {
            "model": found.model,
            "text": found.text,
            "tokens": list(found.tokens),
            "shown_tokens": [display_token(token) for token in found.tokens],
            "special": None
            if not found.attribution or found.attribution[0].special_mask is None
            else found.attribution[0].special_mask,
            "answer": answer_of(found),
            "plan": found.plan.to_dict(),
            "evidence": {
                "attribution": _attribution(found),
                "value_rollout": None if found.value_rollout is None else {"scores": found.value_rollout},
                "routes": _routes(found),
                "patching": _patching(found),
            },
            "token_scores": found.token_scores(),
            "agreement": found.agreement,
            "paragraphs": found.paragraphs,
            "shown": found.shown,
            "seconds": found.seconds,
        }
    )


def _explanation(explanation: Any) -> dict[str, Any]:
    from attnflow.explanation import faithfulness_level

    faithful = explanation.faithfulness
    return {
        "method": explanation.method,
        "scores": explanation.scores,
        "signed": explanation.signed,
        "faithfulness": faithful,
        "level": None if faithful is None else faithfulness_level(faithful),
        "chosen_by": explanation.chosen_by,
    }


def _attribution(found: Any) -> dict[str, Any] | None:
    if not found.attribution:
        return None
    auto, loo = found.attribution[0], found.attribution[-1]
    return {**_explanation(auto), "leave_one_out": _explanation(loo) if loo is not auto else None}


def _routes(found: Any) -> dict[str, Any] | None:
    routes = found.routes
    if routes is None:
        return None
    content = routes.content()
    edge = found.strongest_move()
    return {
        "position": routes.position,
        "threshold": routes.threshold,
        "prediction": content["prediction"],
        "target": content["target"],
        "contrast": content["contrast"],
        "input_importance": content["importance_full"]["inputs"][0],
        "input_importance_route": content["importance"]["inputs"][0],
        "first_top_stream": routes.first_top_stream(),
        "lens": [
            entry for entry in content["lens"] if entry["node"][0] == "in" and entry["node"][2] == routes.position
        ],
        "strongest_move": None if edge is None else edge.to_dict(),
        "components": content["components"],
        "n_layers": routes.n_layers,
    }


def _patching(found: Any) -> dict[str, Any] | None:
    result = found.patching
    if result is None:
        return None
    method, effects = next(iter(result.effects.items()))
    edge = found.strongest_move()
    return {
        "method": method,
        "metric": result.metric,
        "clean_metric": result.clean_metric,
        "corrupt_metric": result.corrupt_metric,
        "corrupt_text": result.corrupt_text,
        "noise_words": result.noise_words,
        "samples": result.samples,
        "residual": effects["residual"],
        "knockout": None
        if "knockout" not in effects or edge is None
        else {
            "source": int(edge.source[2]),
            "target": int(edge.target[2]),
            "layer": int(edge.layer),
            "effect": found.knockout_effect(),
            "per_layer": effects["knockout"][:, edge.source[2]],
        },
        "seconds": result.seconds,
    }
