"""`attnflow.explore`: every registered method for one text, gathered for the interactive explorer.

    exploration = attnflow.explore("minilm", "The movie was terrible, but the acting was great.")
    exploration.save("out/explore")        # out/explore/explorer.html, one self-contained file
    exploration                            # in a notebook: the explorer itself

The explorer is built over the method registry, with no list of methods of its own. Each method
contributes a `MethodView`:

* a method whose function takes ``layerwise`` gives one ``[query, key]`` matrix per layer
  (rollout: R⁽ˡ⁾, the composition through layer l; raw: A⁽ˡ⁾); any other method gives its final
  matrix only;
* a method that accepts ``head_fusion="none"`` also gives one matrix per head (rollout: the
  head-specific rollout, each head composed with itself);
* a method that needs more than a trace holds (gradients, a target) is run by the model's own
  front door, ``model.explain([text], method=..., target=...)``, when the model has one: its
  Explanation's matrix, or, for attribution-only methods (one score per token), its scores;
* per-layer diagnostics (row entropy, special-token share, top token, flags; see
  `attnflow.methods.diagnostics`) of every method with non-negative matrices;
* summary sentences (`attnflow.methods.summary`) of every view for the default saliency row.

The trace's per-head context similarity (`attnflow.methods.similarity`) comes along when the
trace holds head outputs. Nothing here draws: `attnflow.viz.explorer` turns an `Exploration` into
the page.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.explanation import apply_method, default_row, explain, parse_row
from attnflow.methods.diagnostics import is_causal, layer_diagnostics
from attnflow.methods.registry import MethodSpec, available_methods, get_method
from attnflow.methods.saliency import Row, saliency_row
from attnflow.methods.similarity import context_similarity
from attnflow.methods.summary import row_subject, summarize
from attnflow.trace import Trace

EXPLORER_FILE = "explorer.html"
# What a Trace can hand to a method without running the model again.
TRACE_NEEDS = frozenset({"attentions", "head_outputs", "output_weights"})
# Methods that a default exploration (no explicit method list) leaves out above this many tokens,
# because their cost grows too fast (attention flow: a max-flow per output row).
EXPENSIVE_ABOVE = {"flow": 128}


@dataclass
class MethodView:
    """One method's relevance for one text, as the explorer shows it.

    Attributes:
        name / description: the registry's name and one-line summary.
        matrices: ``[view, query, key]``: per layer for layerwise methods (view v is layer
            ``first_layer + v``), else ``[1, query, key]`` (the final matrix); None for
            attribution-only methods.
        head_matrices: ``[view, head, query, key]`` per head, or None.
        scores: ``[token]`` scores of attribution-only methods (None when ``matrices`` exist:
            the page takes a row of the matrix).
        first_layer: the layer of view 0, or None when the method gives its final matrix only.
        summaries: ``{"fused": [view], "heads": [view][head]}`` summary sentences for the
            default row (``"heads"`` only with head matrices).
        diagnostics: ``{"fused": {...}, "heads": {...}}`` `LayerDiagnostics.to_dict()` of the
            fused and per-head matrices (fields ``[view]`` and ``[view, head]``), or None.
        note: why something is missing (e.g. no diagnostics for signed scores).
    """

    name: str
    description: str
    matrices: np.ndarray | None = None
    head_matrices: np.ndarray | None = None
    scores: np.ndarray | None = None
    first_layer: int | None = None
    summaries: dict[str, list] = field(default_factory=dict)
    diagnostics: dict[str, dict] | None = None
    note: str = ""

    @property
    def n_views(self) -> int:
        return 0 if self.matrices is None else int(self.matrices.shape[0])


@dataclass
class Exploration:
    """Everything the explorer page shows for one text.

    Attributes:
        tokens / special_mask ``[token]`` / offsets ``[token, 2]`` / text / model: the input.
        n_layers / n_heads: the model's shape.
        row: the default saliency row (``"mean"``, ``"cls"``, ``"last"`` or an index).
        causal: True for decoders (row i reaches keys 0 … i only).
        methods: one `MethodView` per method shown.
        similarity: ``[layer, head, query, key]`` context similarity S = Z Zᵀ (diagonal 0), or None.
        skipped: ``{method: why}`` for methods left out.
    """

    tokens: list[str]
    special_mask: np.ndarray
    offsets: np.ndarray | None
    text: str
    model: str
    n_layers: int
    n_heads: int
    row: Row
    causal: bool
    methods: list[MethodView]
    similarity: np.ndarray | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def method(self, name: str) -> MethodView:
        for view in self.methods:
            if view.name == name:
                return view
        raise KeyError(f"method {name!r} is not in this exploration; it has {[v.name for v in self.methods]}")

    def to_html(self) -> str:
        """The explorer as one self-contained HTML page (inline script and data, no network)."""
        from attnflow.viz.explorer import explorer_html

        return explorer_html(self)

    def _repr_html_(self) -> str:
        from attnflow.viz.explorer import explorer_iframe

        return explorer_iframe(self)

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/explorer.html`` (creating the folder); returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / EXPLORER_FILE
        path.write_text(self.to_html(), encoding="utf-8")
        return path


def explore(
    source: Any,
    text: str | None = None,
    *,
    methods: Sequence[str] | None = None,
    row: Row | None = None,
    max_length: int | None = None,
    target: Any = None,
    progress: bool = False,
) -> Exploration:
    """Run every requested method on one text and gather what the explorer page shows.

    Args:
        source: a loaded model (`attnflow.load(...)`), a model name to load, or a `Trace`
            (then ``text`` is not needed, and methods that must re-run the model are skipped).
        text: the text to explore.
        methods: registry names; None: every registered method (those in ``EXPENSIVE_ABOVE``
            only up to their token limit).
        row: default saliency row (None: the model's, see `attnflow.explanation.default_row`).
        max_length: truncate the text to this many tokens.
        target: passed to ``model.explain`` for target-dependent methods.
        progress: show a progress bar over the methods (stderr).

    Raises:
        ValueError: an unknown method, or an explicitly requested method that cannot run.
    """
    model = None
    if isinstance(source, Trace):
        trace = source
    else:
        if text is None or not str(text).strip():
            raise InputError("the text to explore is empty")
        if isinstance(source, str):
            from attnflow.capture import load

            source = load(source)
        model = source
        trace = model.trace([text], max_length=max_length)[0]
    if trace.grid is not None:
        raise InputError("the explorer shows text; explain images with `attnflow explain --image`")
    row = parse_row(row) if row is not None else default_row(trace)
    names, skipped = _chosen_methods(methods, trace.n_tokens)
    views = []
    for name in _progress(names, progress):
        try:
            views.append(method_view(name, trace, row, model=model, target=target))
        except (ValueError, InputError) as error:
            if methods is not None:
                raise
            skipped[name] = str(error)
    special = np.asarray(trace.special_mask, dtype=bool)
    similarity = None
    if trace.head_outputs is not None:
        similarity = np.asarray(context_similarity(trace.head_outputs), dtype=np.float64)
    return Exploration(
        tokens=list(trace.tokens),
        special_mask=special,
        offsets=None if trace.offsets is None else np.asarray(trace.offsets),
        text=trace.text,
        model=trace.model_name,
        n_layers=int(trace.attentions.shape[0]),
        n_heads=int(trace.attentions.shape[1]),
        row=row,
        causal=is_causal(trace.attentions),
        methods=views,
        similarity=similarity,
        skipped=skipped,
    )


def method_view(name: str, trace: Trace, row: Row, model: Any = None, target: Any = None) -> MethodView:
    """A `MethodView` of one registered method (see the module docstring for what it holds)."""
    spec = get_method(name)
    needs = set(getattr(spec, "needs", ()) or ("attentions",))
    if needs <= TRACE_NEEDS:
        view = _view_from_trace(spec, trace)
    elif model is not None and hasattr(model, "explain"):
        view = _view_from_explanation(spec, model.explain([trace.text], method=name, target=target)[0], trace.n_tokens)
    else:
        missing = ", ".join(sorted(needs - TRACE_NEEDS))
        raise ValueError(f"method {name!r} needs {missing}: explore it with a model that has explain(), not a trace")
    _add_summaries(view, trace, row)
    _add_diagnostics(view, trace)
    return view


def explain_scores(name: str, trace: Trace, row: Row, model: Any = None, target: Any = None) -> np.ndarray:
    """``[token]`` saliency scores of one method for one trace (the row of its final matrix, or
    an attribution-only method's scores); target-dependent methods go through ``model.explain``."""
    spec = get_method(name)
    needs = set(getattr(spec, "needs", ()) or ("attentions",))
    if needs <= TRACE_NEEDS:
        return explain(trace, method=name, row=row).scores
    view = method_view(name, trace, row, model=model, target=target)
    return view.scores if view.scores is not None else saliency_row(view.matrices[-1], row)


def _chosen_methods(methods: Sequence[str] | None, n_tokens: int) -> tuple[list[str], dict[str, str]]:
    if methods is not None:
        names = list(dict.fromkeys(methods))
        if not names:
            raise ValueError("no methods to explore")
        for name in names:
            get_method(name)  # unknown names fail here, before any work
        return names, {}
    names, skipped = [], {}
    for name in available_methods():
        limit = EXPENSIVE_ABOVE.get(name)
        if limit is not None and n_tokens > limit:
            skipped[name] = f"left out for {n_tokens} tokens (slow above {limit}); ask for it by name to include it"
        else:
            names.append(name)
    return names, skipped


def _view_from_trace(spec: MethodSpec, trace: Trace) -> MethodView:
    n = trace.n_tokens
    parameters = inspect.signature(spec.function).parameters
    layerwise = {"layerwise": True} if "layerwise" in parameters else {}
    result = np.asarray(apply_method(spec, trace, **layerwise), dtype=np.float64)
    if layerwise:
        matrices = result  # [layer, query, key]
        first_layer = trace.attentions.shape[0] - matrices.shape[0]
    else:
        matrices, first_layer = result[None], None  # [1, query, key]
    if matrices.ndim != 3 or matrices.shape[1:] != (n, n):
        raise ValueError(f"method {spec.name!r} returned shape {result.shape}; expected [(layer,) query, key]")
    head_matrices = None
    if "head_fusion" in spec.options:
        try:
            per_head = np.asarray(apply_method(spec, trace, head_fusion="none", **layerwise), dtype=np.float64)
        except ValueError:  # the method cannot keep heads apart (e.g. attention flow)
            per_head = None
        if per_head is not None:
            head_matrices = per_head if layerwise else per_head[None]  # [view, head, query, key]
            if head_matrices.shape[0] != matrices.shape[0] or head_matrices.shape[2:] != (n, n):
                raise ValueError(f"method {spec.name!r} returned per-head shape {per_head.shape}")
    return MethodView(spec.name, spec.summary, matrices=matrices, head_matrices=head_matrices, first_layer=first_layer)


def _view_from_explanation(spec: MethodSpec, explanation: Any, n: int) -> MethodView:
    """A final-only view from an Explanation: its ``[query, key]`` matrix, or its scores alone."""
    matrix = getattr(explanation, "matrix", None)
    scores = np.asarray(explanation.scores, dtype=np.float64).reshape(-1)
    if scores.shape != (n,):
        raise ValueError(f"method {spec.name!r} gave {scores.size} scores for {n} tokens")
    if matrix is not None and np.shape(matrix) == (n, n):
        return MethodView(spec.name, spec.summary, matrices=np.asarray(matrix, dtype=np.float64)[None])
    return MethodView(spec.name, spec.summary, scores=scores, note="attribution-only: one score per token, no matrix")


def _add_summaries(view: MethodView, trace: Trace, row: Row) -> None:
    subject = row_subject(row, trace.tokens)

    def sentence(scores: np.ndarray) -> str:
        return summarize(trace.tokens, scores, subject, trace.special_mask, trace.text, trace.offsets)

    if view.matrices is None:
        view.summaries = {"fused": [sentence(view.scores)]}
        return
    view.summaries = {"fused": [sentence(saliency_row(matrix, row)) for matrix in view.matrices]}
    if view.head_matrices is not None:
        view.summaries["heads"] = [[sentence(saliency_row(m, row)) for m in heads] for heads in view.head_matrices]


def _add_diagnostics(view: MethodView, trace: Trace) -> None:
    if view.matrices is None:
        return
    if np.any(view.matrices < 0) or (view.head_matrices is not None and np.any(view.head_matrices < 0)):
        view.note = "no row diagnostics: the matrix has negative entries"
        return
    causal = is_causal(trace.attentions)
    view.diagnostics = {"fused": layer_diagnostics(view.matrices, trace.special_mask, causal).to_dict()}
    if view.head_matrices is not None:
        view.diagnostics["heads"] = layer_diagnostics(view.head_matrices, trace.special_mask, causal).to_dict()


def _progress(names: list[str], show: bool) -> Any:
    if not show:
        return names
    from tqdm import tqdm

    return tqdm(names, desc="methods", unit="method", file=sys.stderr)
