"""The explorer's generation view: one self-contained page for a `GenerationExploration`
(`attnflow.generation_exploration`, which imports this module, never the other way round).

It is built like the explorer page (`attnflow.viz.explorer`: the same Content-Security-Policy,
metadata block, data chunks and chunk decoder, ``viz/assets/data.js``), with its own viewer
``viz/assets/generation_explorer.{js,css,html}``. The metadata holds the tokens (raw, shown with
`display_token`, and each token's piece of the decoded text), p(t_k) per step and per method its
summary, top sources (exact), per-step faithfulness and notes; the data chunks hold each method's
``[step, source]`` matrix (one chunk, reference shape ``[1, step, source]``) and, for layerwise
methods, ``[layer, step, source]`` (one chunk per layer), one scale per step. The special tokens'
columns and the first token's are stored exactly: a decoder parks most of its attention on its
first token (an attention sink) whether or not it is a BOS, and the 7-bit codes of the other
sources then keep their own precision (smollm2's rollout: 98 % on "The").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.tokens import display_token
from attnflow.viz.explorer import Chunks, asset, interactive_page, page_script

TOP_SOURCES = 3


def generation_explorer_payload(exploration: Any) -> tuple[dict[str, Any], Chunks]:
    """The metadata (JSON-serialisable) and the data chunks of the page."""
    first = exploration.first
    chunks = Chunks()
    exact_columns = sorted({0, *np.flatnonzero(first.special_mask[: len(first.sources)]).tolist()})
    methods = []
    for view in exploration.views:
        explanation = view.explanation
        methods.append(
            {
                "name": view.name,
                "description": view.description,
                "signed": view.signed,
                "options": {key: str(value) for key, value in explanation.options.items() if value is not None},
                "matrix": chunks.add(explanation.matrix[None], exact_columns),
                "layers": None if view.layers is None else chunks.add(view.layers, exact_columns),
                "first_layer": view.first_layer,
                "top": [
                    [[index, score] for index, _, score in explanation.top_sources(step, TOP_SOURCES)]
                    for step in range(explanation.n_steps)
                ],
                "faithfulness": _faithfulness(explanation.faithfulness),
                "extras": explanation.step_extras,
                "notes": list(explanation.notes),
            }
        )
    tokens = exploration.tokens
    meta = {
        "model": first.model,
        "prompt": first.prompt,
        "mode": first.mode,
        "continuation": first.continuation,
        "n_prompt": first.n_prompt,
        "tokens": tokens,
        "display": [display_token(token) for token in tokens],
        "pieces": list(exploration.pieces),
        "special": first.special_mask.tolist(),
        "n_layers": exploration.n_layers,
        "steps": [
            {"log_prob": float(log_p), "probability": float(p)}
            for log_p, p in zip(first.log_probs, first.probabilities, strict=True)
        ],
        "methods": methods,
        "top_sources": TOP_SOURCES,
        "skipped": exploration.skipped,
    }
    return meta, chunks


def generation_explorer_html(exploration: Any) -> str:
    """The complete page."""
    meta, chunks = generation_explorer_payload(exploration)
    first = exploration.first
    return interactive_page(
        title=f"attnflow generation explorer: {first.model or 'model'}",
        subtitle=(
            f"{first.n_prompt} prompt tokens · {first.n_steps} {first.mode} tokens · {exploration.n_layers} layers · "
            f"{len(exploration.views)} methods"
        ),
        source=first.prompt,
        script=page_script("generation_explorer.js"),
        style=asset("explorer.css") + asset("generation_explorer.css"),
        body=asset("generation_explorer.html"),
        meta=meta,
        chunks=chunks,
    )


def _faithfulness(faithfulness: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the page shows of `step_faithfulness`: per step its AOPC and p without its top sources."""
    if faithfulness is None:
        return None
    return {
        "bins": faithfulness["bins"],
        "replace": faithfulness["replace"],
        "aopc": faithfulness["aopc"],
        "perturbed": faithfulness["perturbed_probability"],
        "mean_aopc": faithfulness["mean_aopc"],
    }
