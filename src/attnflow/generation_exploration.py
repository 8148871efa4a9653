"""`attnflow.explore_generation`: the explorer's generation view, every token a causal LM generates
explained by several methods on one interactive page.

    model = attnflow.load("smollm2")
    exploration = attnflow.explore_generation(model, "The capital of France is", max_new_tokens=8)
    exploration.save("out/genview")        # out/genview/explorer.html, one self-contained file
    exploration                            # in a notebook: the page itself

Each method's ``[step, source]`` matrix, log p(t_k) and per-step faithfulness are
`attnflow.explain_generation`'s (`explain_continuation`, all methods on one continuation). A
method that gives one matrix per layer (``layerwise``: rollout, raw, norm, norm_rollout) also
gives step k's sources at every layer: row P + k − 1 of that layer's matrix over the whole
sequence (a decoder's attention is causal, so that row is the last row on step k's prefix alone).
Nothing here draws: `attnflow.viz.generation_explorer` turns a `GenerationExploration` into the page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnflow.generation import (
    DEFAULT_STEPS_PER_PASS,
    GenerationExplanation,
    check_generation_method,
    explain_continuation,
    generation_methods,
    prepare_continuation,
    sequence_trace,
)
from attnflow.methods.extras import split
from attnflow.methods.registry import available_methods, call_method, get_method, method_options
from attnflow.model_like import ModelLike
from attnflow.tokens import display_token


@dataclass
class GenerationView:
    """One method's explanation of every generated token, as the page shows it.

    Attributes:
        explanation: the method's `GenerationExplanation` (``[step, source]`` matrix, log p(t_k),
            top sources, per-step faithfulness).
        description: the registry's one-line summary.
        signed: the scores are signed (> 0 supports t_k, < 0 speaks against it).
        layers: ``[layer, step, source]`` step k's scores after each layer (layerwise methods; layer
            v is ``first_layer + v``), 0 at and after t_k's position; None for other methods.
        first_layer: the layer of ``layers[0]``, or None without layers.
    """

    explanation: GenerationExplanation
    description: str
    signed: bool = False
    layers: np.ndarray | None = None
    first_layer: int | None = None

    @property
    def name(self) -> str:
        return self.explanation.method


@dataclass
class GenerationExploration:
    """Everything the generation view shows: one `GenerationView` per method, all over the same
    prompt and continuation.

    Attributes:
        views: one per method shown.
        pieces: ``[P + N]`` each token's share of the decoded text (the running text of the page).
        n_layers: the model's layers.
        skipped: ``{method: why}`` for the registered methods left out.
    """

    views: list[GenerationView]
    pieces: list[str]
    n_layers: int
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def first(self) -> GenerationExplanation:
        """The first method's explanation: the prompt, tokens and log p(t_k) all views share."""
        return self.views[0].explanation

    @property
    def tokens(self) -> list[str]:
        """``[P + N]`` the prompt's and the continuation's tokens."""
        return [*self.first.sources, self.first.generated[-1]]

    def method(self, name: str) -> GenerationView:
        for view in self.views:
            if view.name == name:
                return view
        raise KeyError(f"method {name!r} is not in this exploration; it has {[v.name for v in self.views]}")

    def to_html(self) -> str:
        """The generation view as one self-contained HTML page (inline script and data, no network)."""
        from attnflow.viz.generation_explorer import generation_explorer_html

        return generation_explorer_html(self)

    def _repr_html_(self) -> str:
        from attnflow.viz.explorer import sandboxed_iframe

        return sandboxed_iframe(self.to_html(), height=900)

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write ``directory/explorer.html``, as `Exploration.save` does; returns its path."""
        from attnflow.exploration import save_explorer_page

        return save_explorer_page(self.to_html(), directory, overwrite)


def explore_generation(
    source: Any,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    continuation: str | None = None,
    methods: Sequence[str] | None = None,
    faithfulness: bool = False,
    steps_per_pass: int = DEFAULT_STEPS_PER_PASS,
) -> GenerationExploration:
    """Explain every token a causal LM generates after ``prompt`` with several methods, for the page.

    Args:
        source: a loaded causal LM (`attnflow.load("smollm2")`) or a model name to load.
        prompt / max_new_tokens / continuation: as in `attnflow.explain_generation` (greedy
            generation of ``max_new_tokens``, or the given ``continuation`` teacher-forced).
        methods: registry names (each must explain generations); None: every method that does,
            supports the model's family and is not declared ``cost="expensive"`` (flow, leave-one-out,
            integrated gradients, SHAP: listed in ``skipped``, ask for them by name).
        faithfulness: per step, p(t_k) after removing its top sources, for every method.
        steps_per_pass: step copies per forward (and backward) pass of the target methods.
    """
    if isinstance(source, str):
        from attnflow.model import load

        source = load(source)
    model = source
    names, skipped = _requested(model, methods)
    per_method = {name: method_options(check_generation_method(model, name), {}) for name in names}
    sequence = prepare_continuation(model, prompt, max_new_tokens=max_new_tokens, continuation=continuation)
    explanations = explain_continuation(model, sequence, per_method, faithfulness, steps_per_pass)
    layerwise = [get_method(name) for name in names if get_method(name).layerwise]
    trace = None
    if layerwise:
        trace = sequence_trace(model, sequence, frozenset().union(*(spec.needs for spec in layerwise)))
    views = []
    for explanation in explanations:
        spec = get_method(explanation.method)
        view = GenerationView(
            explanation,
            spec.summary,
            signed=spec.signed or bool(explanation.options.get("signed")),
        )
        if trace is not None and spec.layerwise:
            matrices, _ = split(call_method(spec, trace, model=model, layerwise=True, **per_method[spec.name]))
            view.layers = step_rows(np.asarray(matrices, dtype=np.float64), sequence.n_prompt)
            view.first_layer = model.n_layers - view.layers.shape[0]
        views.append(view)
    first = explanations[0]
    return GenerationExploration(
        views=views,
        pieces=text_pieces(model.tokenizer, sequence.ids.tolist(), [*first.sources, first.generated[-1]]),
        n_layers=model.n_layers,
        skipped=skipped,
    )


def step_rows(matrices: np.ndarray, n_prompt: int) -> np.ndarray:
    """``[..., step, source]`` from ``[..., query, key]`` matrices over the S sources: step k is row
    P + k − 1 (the position that predicts its token), its first P + k entries, 0 after."""
    n_sources = matrices.shape[-1]
    rows = np.zeros((*matrices.shape[:-2], n_sources - n_prompt + 1, n_sources))
    for step in range(rows.shape[-2]):
        rows[..., step, : n_prompt + step] = matrices[..., n_prompt + step - 1, : n_prompt + step]
    return rows


def text_pieces(tokenizer: Any, ids: list[int], tokens: list[str]) -> list[str]:
    """Each token's share of the decoded text: how far decoding ``ids[: i + 1]`` extends decoding
    ``ids[: i]``. A token that adds nothing or rewrites the text before it (a piece of a UTF-8
    character, spaces the tokenizer cleans up) shows as `display_token` of its string."""
    pieces, before = [], ""
    for i, token in enumerate(tokens):
        text = tokenizer.decode(ids[: i + 1])
        grows = len(text) > len(before) and text.startswith(before)
        pieces.append(text[len(before) :] if grows else display_token(token))
        before = text
    return pieces


def _requested(model: ModelLike, methods: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The methods to run and, for the default, ``{method: why}`` of the registered ones left out."""
    if methods is not None:
        names = list(dict.fromkeys(methods))
        if not names:
            raise ValueError("no methods to explore")
        return names, {}
    family = model.adapter
    explaining = set(generation_methods())
    names, skipped = [], {}
    for name in available_methods():
        spec = get_method(name)
        if name not in explaining:
            skipped[name] = "does not explain generated tokens"
        elif not spec.supports(family):
            skipped[name] = f"does not support the {family.family} family"
        elif spec.cost == "expensive":
            skipped[name] = "slow, declared expensive: name it in --methods to include it"
        else:
            names.append(name)
    return names, skipped
