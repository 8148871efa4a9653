"""`Why`: what `attnflow.why` found about one prediction — the plan, each piece of evidence, their
agreement and the reading — and how it saves itself (``why.json``, ``why.html``).

The scores compared (``[token]``, each as its own command writes it):

- ``attribution``: auto's map (explanation.json ``scores``; a signed map's |scores|: a token
  against the answer matters as much as one for it); ``leave-one-out``: leave-one-out's, the same;
- ``routes``: each input token's importance with every edge kept (routes.json
  ``importance_full.inputs[0]``: the route at threshold 0, so no token is cut to 0 by the threshold);
- ``patching``: each position's largest effect over the residual rows (patch.json
  ``effects.<method>.residual``, the stream leaving the last layer left out: 1 by definition).

The layers compared (each named as the stream leaving layer n, -1 the embeddings):

- ``lens``: from where on the logit lens's top token at the predicting position is the answer
  (`attnflow.Routes.first_top_stream`);
- ``patching``: the first stream at the predicting position that restores half of the answer on its
  own (`attnflow.causal.labels.handover_row`);
- ``route``: the layer of the route's strongest attention edge from another position into the
  predicting position (`strongest_move`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attnflow.question.agreement import layer_agreement, token_agreement
from attnflow.question.plan import Plan

JSON_FILE = "why.json"
HTML_FILE = "why.html"
PNG_FILE = "why.png"
OUTPUT_FILES = (JSON_FILE, HTML_FILE, PNG_FILE)
# The page is built by `attnflow.viz.why` from why.json's content; the package root fills this
# table, loading it on first use (this module imports no view).
_VIEWS: dict[str, Callable[..., Any]] = {}


def is_why_file(name: str) -> bool:
    """Whether an entry of an output folder is one `Why.save` writes."""
    return name in OUTPUT_FILES


@dataclass
class Why:
    """The evidence about one prediction (``T`` tokens); see the module docstring for the scores
    and layers compared. ``attribution``: auto's `Explanation` and leave-one-out's; ``routes``: the
    `attnflow.Routes` (causal LMs); ``patching``: the `attnflow.PatchResult` (exact, or AtP's
    estimate over the budget) with its knockout; ``value_rollout``: ``[T]`` norm_rollout's scores
    (encoders); ``noise``: the word the built counterfactual noised; ``seconds``: each step's time."""

    model: str
    text: str
    tokens: list[str]
    plan: Plan
    attribution: list[Any] = field(default_factory=list)
    routes: Any = None
    patching: Any = None
    value_rollout: np.ndarray | None = None
    noise: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    agreement: dict[str, Any] = field(default_factory=dict)
    shown: dict[str, dict[str, Any]] = field(default_factory=dict)
    paragraphs: list[dict[str, str]] = field(default_factory=list)

    # ----- what the evidence says about the same things ------------------------------------------

    @property
    def position(self) -> int:
        """The predicting position (a causal LM's last token; a classifier's reads the whole text)."""
        return len(self.tokens) - 1

    def token_scores(self) -> dict[str, np.ndarray]:
        """``[T]`` scores of which input tokens matter, per kind of evidence that ran."""
        from attnflow.flow_routes.result import DIGITS

        scores: dict[str, np.ndarray] = {}
        if self.attribution:  # a signed map's tokens matter by their size, for or against the answer
            auto, loo = self.attribution[0], self.attribution[-1]
            scores["attribution"] = np.abs(auto.scores) if auto.signed else auto.scores
            scores["leave-one-out"] = np.abs(loo.scores) if loo.signed else loo.scores
        if self.value_rollout is not None:
            scores["value-aware rollout"] = np.asarray(self.value_rollout)
        if self.routes is not None:
            scores["routes"] = np.round(self.routes.importance_full.inputs[0], DIGITS)  # as routes.json holds it
        residual = self.residual()
        if residual is not None:
            scores["patching"] = np.nanmax(residual[:-1], axis=0)
        return scores

    def residual(self) -> np.ndarray | None:
        """``[L + 1, T]`` the residual patching effects (exact or estimated), or None."""
        if self.patching is None:
            return None
        return next(iter(self.patching.effects.values()))["residual"]

    def strongest_move(self) -> Any:
        """The route's strongest attention edge from another position into the predicting position
        (`attnflow.flow_routes.graph.Edge`), or None (no routes, or no such edge on the route)."""
        if self.routes is None:
            return None
        moves = [
            edge
            for edge in self.routes.edges
            if edge.kind == "attention" and edge.target[2] == self.routes.position and edge.source[2] != edge.target[2]
        ]
        return max(moves, key=lambda edge: edge.importance, default=None)

    def layers(self) -> dict[str, int | None]:
        """The layer each kind of evidence names (the stream leaving it; -1: the embeddings)."""
        from attnflow.causal.labels import handover_row

        layers: dict[str, int | None] = {}
        if self.routes is not None:
            first = self.routes.first_top_stream()
            layers["lens"] = None if first is None else first - 1
        residual = self.residual()
        if residual is not None and self.routes is not None:
            row = handover_row(residual, self.routes.position)
            layers["patching"] = None if row is None else row - 1
        edge = self.strongest_move()
        if self.routes is not None:
            layers["route"] = None if edge is None else int(edge.layer)
        return layers

    def knockout_effect(self) -> float | None:
        """The effect of blocking the strongest move edge at its layer (exact knockout), or None."""
        edge = self.strongest_move()
        if self.patching is None or edge is None or "knockout" not in self.patching.effects.get("exact", {}):
            return None
        value = self.patching.effects["exact"]["knockout"][edge.layer, edge.source[2]]
        return None if np.isnan(value) else float(value)

    def finish(self) -> None:
        """Measure the agreement and write the reading (after every step has run)."""
        from attnflow.question.wording import reading

        keep = np.ones(len(self.tokens), dtype=bool)
        if self.attribution and self.attribution[0].special_mask is not None:
            keep = ~self.attribution[0].special_mask
        self.agreement = {
            "tokens": token_agreement(self.token_scores(), keep),
            "layers": layer_agreement(self.layers()) if self.routes is not None else None,
        }
        self.shown, self.paragraphs = reading(self)

    # ----- saving -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Everything ``why.json`` holds (see docs/why.md)."""
        from attnflow.question.serialise import why_dict

        return why_dict(self)

    def to_json(self) -> str:
        """``why.json`` as a string."""
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)

    def summary(self) -> str:
        """The reading, one paragraph per question, for the console."""
        return "\n\n".join(f"{entry['question']}\n{entry['text']}" for entry in self.paragraphs)

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write ``why.json``, ``why.html`` and ``why.png`` together, atomically; earlier ones are replaced only
        with ``overwrite=True``. Returns the page's path."""
        from attnflow.staging import staged_output

        directory = Path(directory)
        data = self.to_dict()
        with staged_output(directory, is_why_file, overwrite) as scratch:
            (scratch / JSON_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
            (scratch / HTML_FILE).write_text(_VIEWS["html"](data), encoding="utf-8")
            (scratch / PNG_FILE).write_bytes(_VIEWS["png"](data))
        return directory / HTML_FILE

    def _repr_html_(self) -> str:
        """In a notebook: the page."""
        return _VIEWS["html"](self.to_dict())

    def __repr__(self) -> str:
        """One line: the model, the text, the evidence that ran."""
        return f"Why(model={self.model!r}, text={self.text!r}, evidence={list(self.token_scores())})"
