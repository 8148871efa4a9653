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
* an attribution-only method (``scores_only``: gradients, leave-one-out, ...) gives its scores,
  one per token, and no matrix;
* what the methods need is captured once for all of them (`AttentionModel.trace(needs=...)`),
  plus one pass with a backward pass for the target-dependent ones; methods that re-run the
  model get it;
* per-layer diagnostics (row entropy, special-token share, top token, flags; see
  `attnflow.methods.diagnostics`) of every method with non-negative matrices;
* summary sentences (`attnflow.methods.summary`) of every view for the default saliency row.

The trace's per-head context similarity (`attnflow.methods.similarity`) comes along when the
trace holds head outputs. Nothing here draws: `attnflow.viz.explorer` turns an `Exploration` into
the page.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.errors import AttnflowError, InputError
from attnflow.explanation import default_row, parse_row, run_noting_warnings
from attnflow.methods.diagnostics import is_causal, layer_diagnostics
from attnflow.methods.extras import split
from attnflow.methods.registry import MethodSpec, available_methods, call_method, check_family, get_method
from attnflow.methods.saliency import Row, saliency_row
from attnflow.methods.similarity import context_similarity
from attnflow.methods.summary import baseline_prefix, subject, summarize
from attnflow.model_like import ModelLike
from attnflow.staging import staged_output
from attnflow.trace import Trace

# The views ("html", "fragment": an iframe for notebooks) live in attnflow.viz.explorer and read
# Explorations; the package root (attnflow/__init__.py) fills this table, so this module imports no view.
_VIEWS: dict[str, Callable[..., Any]] = {}
# ``faithfulness(model, exploration, target=, max_length=)`` sets each view's per-input faithfulness
# (`attnflow.evaluate.per_input.add_view_faithfulness`, which builds on the evaluate package and
# so on its report's views); the package root fills it too.
_MEASURES: dict[str, Callable[..., None]] = {}

EXPLORER_FILE = "explorer.html"
# `Exploration.save` warns above this page size (browsers open such files slowly).
LARGE_PAGE_BYTES = 50_000_000
# What the page always wants from the forward pass: head outputs for the context similarity.
PAGE_NEEDS = frozenset({"attentions", "head_outputs", "output_weights"})
# A default exploration (no explicit method list) leaves the methods declared ``cost="expensive"``
# out above this many tokens (attention flow: a max-flow per output row; value zeroing and
# leave-one-out: a forward pass per token).
EXPENSIVE_ABOVE = 128


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
        signed: the scores are signed (> 0 supports the target, < 0 speaks against it).
        faithfulness: the per-input comprehensiveness and sufficiency of `saliency` at the default
            row (`attnflow.evaluate.per_input.add_view_faithfulness`), or None.
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
    signed: bool = False
    faithfulness: dict[str, Any] | None = None

    @property
    def n_views(self) -> int:
        return 0 if self.matrices is None else int(self.matrices.shape[0])

    def saliency(self, row: Row) -> np.ndarray:
        """``[token]`` the scores of an attribution-only method, else ``row`` of the last view's matrix."""
        if self.matrices is not None:
            return saliency_row(self.matrices[-1], row)
        assert self.scores is not None, "a view holds scores or matrices"
        return self.scores


@dataclass
class Exploration:
    """Everything the explorer page shows for one text.

    Attributes:
        tokens / special_mask ``[token]`` / offsets ``[token, 2]`` / text / model: the input.
        n_layers / n_heads: the model's shape.
        layer_labels: the block index of each attention layer ``[layer]`` where they are some blocks
            of a hybrid stack only (its "layer 0" may be block 1); None: layer l is block l.
        row: the default saliency row (``"mean"``, ``"cls"``, ``"last"`` or an index).
        causal: True for decoders (row i reaches keys 0 … i only).
        methods: one `MethodView` per method shown.
        similarity: ``[layer, head, query, key]`` context similarity S = Z Zᵀ (diagonal 0), or None.
        skipped: ``{method: why}`` for methods left out.
        opens_on / opened_why: the view the page opens on and why: auto's choice (the one-pass
            target method most comprehensive on this input) where the views carry their
            per-input faithfulness, else rollout when present (None: the first view).
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
    opens_on: str | None = None
    opened_why: str = ""
    layer_labels: list[int] | None = None

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
        return _VIEWS["html"](self)

    def _repr_html_(self) -> str:
        return _VIEWS["fragment"](self)

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write ``directory/explorer.html`` (creating the folder); returns its path. An existing
        explorer page is replaced only with ``overwrite=True`` (FileExistsError otherwise). Warns
        when the page is larger than ``LARGE_PAGE_BYTES``."""
        return save_explorer_page(self.to_html(), directory, overwrite)


def save_explorer_page(html: str, directory: str | Path, overwrite: bool = False) -> Path:
    """Write an explorer page as ``directory/explorer.html`` (see `Exploration.save`); returns its path."""
    directory = Path(directory)
    with staged_output(directory, is_explorer_file, overwrite) as scratch:
        (scratch / EXPLORER_FILE).write_text(html, encoding="utf-8")
    path = directory / EXPLORER_FILE
    size = path.stat().st_size
    if size > LARGE_PAGE_BYTES:
        warnings.warn(
            f"{path} is {size / 1e6:.0f} MB (browsers open pages above {LARGE_PAGE_BYTES / 1e6:.0f} MB slowly): "
            "explore fewer tokens (--max-tokens N, max_length=N) or fewer methods (--methods)",
            stacklevel=3,
        )
    return path


def is_explorer_file(name: str) -> bool:
    """Whether a folder entry is `Exploration.save`'s page."""
    return name == EXPLORER_FILE


def explore(
    source: Any,
    text: str | None = None,
    *,
    methods: Sequence[str] | None = None,
    row: Row | None = None,
    max_length: int | None = None,
    target: Any = None,
    target_text: str | None = None,
    faithfulness: bool = True,
    progress: bool = False,
) -> Exploration:
    """Run every requested method on one text and gather what the explorer page shows.

    With a model, one forward pass captures what all the methods without a target need (plus
    head outputs for the context similarity), and one more pass with a backward pass serves the
    target-dependent methods (gradient-weighted rollout, gradients, ...), whose target is
    ``target`` (a `attnflow.targets.Target`, or a class or token for short).

    Args:
        source: a loaded model (`attnflow.load(...)`), a model name to load, or a `Trace`
            (then ``text`` is not needed, and only methods whose needs the trace holds run).
        text: the text to explore.
        methods: registry names; None: every registered method the model supports (those
            declared expensive only up to ``EXPENSIVE_ABOVE`` tokens; methods that cannot run, e.g.
            without a target, are listed in ``skipped`` with the reason).
        row: default saliency row (None: the model's, see `attnflow.explanation.default_row`).
        max_length: truncate the text to this many tokens.
        target: what target-dependent methods explain (``target_text``: the deprecated spelling of
            ``Target(text=...)``).
        faithfulness: with a model that has a class or next-token target, each view's per-input
            faithfulness at ``row`` (its badge on the page; a few batched forward passes,
            `attnflow.evaluate.per_input.add_view_faithfulness`).
        progress: show a progress bar over the methods (stderr).

    Raises:
        ValueError / attnflow errors: an unknown method, or an explicitly requested method that
        cannot run (its reason).
    """
    from attnflow.targets import legacy_target

    wanted = legacy_target(target, target_text, None, "explore")
    model = None if isinstance(source, Trace) else _model(source, text)
    skips = _Skips(strict=methods is not None)
    specs = [get_method(name) for name in _requested(methods)]
    if model is not None:
        assert text is not None  # _model refuses a missing text
        specs = _supported(specs, model, skips)
        base = model.trace([text], needs=_plain_needs(specs), max_length=max_length)[0]
    else:
        base = source
    if base.grid is not None:
        raise InputError("the explorer shows text; explain images instead ({image})", parameter="image")
    traces = {spec.name: base for spec in specs}
    if model is not None:
        specs = _trace_targets(model, str(text), specs, traces, skips, wanted, max_length)
    if methods is None:
        specs = _affordable(specs, base.n_tokens, skips)
    row = parse_row(row) if row is not None else default_row(base)
    views = []
    for spec in _progress(specs, progress):
        missing = _missing_needs(spec, traces[spec.name], model)
        if missing:
            skips.skip(spec.name, f"needs {', '.join(missing)}: explore it with a model, not a trace")
            continue
        views.append(_view_noting(spec.name, traces[spec.name], row, model, asked=methods is not None))
    if not views:
        raise InputError("no method could run: " + "; ".join(f"{name}: {why}" for name, why in skips.skipped.items()))
    exploration = _exploration(base, row, views, skips.skipped)
    exploration.layer_labels = _block_labels(model)
    if faithfulness and model is not None:
        _MEASURES["faithfulness"](model, exploration, target=wanted, max_length=max_length)
    return exploration


def _view_noting(name: str, trace: Trace, row: Row, model: ModelLike | None, asked: bool) -> MethodView:
    """`method_view`; a method the user did not ask for by name (explore's defaults) says its
    warnings (`ExplanationWarning`: e.g. integrated gradients' completeness) only in its view's
    note on the page, not on the console; a method asked for warns as `explain` does."""
    view, noted = run_noting_warnings(lambda: method_view(name, trace, row, model=model), say=asked)
    view.note = "; ".join(filter(None, [view.note, *noted]))
    return view


def _model(source: str | ModelLike, text: str | None) -> ModelLike:
    """The model (loaded here when ``source`` is its name), once ``text`` is known not to be empty."""
    if text is None or not str(text).strip():
        raise InputError("the text to explore is empty")
    if isinstance(source, str):
        from attnflow.model import load

        return load(source)
    return source


class _Skips:
    """The methods left out and why; with ``strict`` (methods asked for by name) a left-out method
    is an error instead."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.skipped: dict[str, str] = {}

    def skip(self, name: str, why: str) -> None:
        if self.strict:
            raise InputError(f"method {name!r} cannot run here: {why}")
        self.skipped[name] = why


def _supported(specs: list[MethodSpec], model: ModelLike, skips: _Skips) -> list[MethodSpec]:
    """The methods the model's family supports; the others skipped with the reason."""
    family = getattr(model, "adapter", None)
    kept = []
    for spec in specs:
        try:
            if family is not None:
                check_family(spec, family)
        except ValueError as error:
            skips.skip(spec.name, str(error))
        else:
            kept.append(spec)
    return kept


def _plain_needs(specs: list[MethodSpec]) -> frozenset[str]:
    """What the forward pass without a target captures: the page's needs and those of every
    method that explains no target."""
    return PAGE_NEEDS.union(*(spec.needs for spec in specs if not spec.uses_target)) - {"model"}


def _trace_targets(
    model: ModelLike,
    text: str,
    specs: list[MethodSpec],
    traces: dict[str, Trace],
    skips: _Skips,
    target: Any,
    max_length: int | None,
) -> list[MethodSpec]:
    """One more pass, with the target and a backward pass, for the target-dependent methods (their
    entries of ``traces`` replaced); when the target cannot be set they are skipped. Returns the
    methods that can run."""
    targeted = [spec for spec in specs if spec.uses_target]
    if not targeted:
        return specs
    needs = frozenset().union(*(spec.needs for spec in targeted)) - {"model"}
    try:
        with_target = model.trace([text], needs=needs, target=target, max_length=max_length)
    except (AttnflowError, ValueError) as error:
        for spec in targeted:
            skips.skip(spec.name, str(error))
        return [spec for spec in specs if not spec.uses_target]
    traces.update({spec.name: with_target[0] for spec in targeted})
    return specs


def _affordable(specs: list[MethodSpec], n_tokens: int, skips: _Skips) -> list[MethodSpec]:
    """Without methods asked for by name: the expensive ones left out above ``EXPENSIVE_ABOVE`` tokens."""
    if n_tokens <= EXPENSIVE_ABOVE:
        return specs
    for spec in specs:
        if spec.cost == "expensive":
            skips.skipped[spec.name] = (
                f"left out for {n_tokens} tokens (slow above {EXPENSIVE_ABOVE}); ask for it by name to include it"
            )
    return [spec for spec in specs if spec.cost != "expensive"]


def _block_labels(model: ModelLike | None) -> list[int] | None:
    """The block index of each attention layer of a hybrid stack (`attnflow.rows.adapters.Stack.gaps`),
    which the explorer's layers are labelled by; None where layer l is block l (or no model, or no
    adapter row, is known: a model-like object of the user's own)."""
    adapter = getattr(model, "adapter", None)
    if adapter is None or not adapter.stack.gaps:
        return None
    from attnflow.rows.adapters import layer_index

    return [layer_index(adapter.stack.attention, name) for name in getattr(model, "layer_names", [])]


def _exploration(base: Trace, row: Row, views: list[MethodView], skipped: dict[str, str]) -> Exploration:
    """The page's data: the tokens and shape of ``base``, the views, and the heads' context similarity."""
    similarity = None
    if base.head_outputs is not None:
        similarity = np.asarray(context_similarity(base.head_outputs), dtype=np.float64)
    return Exploration(
        opens_on="rollout" if any(view.name == "rollout" for view in views) else None,
        tokens=list(base.tokens),
        special_mask=np.asarray(base.special_mask, dtype=bool),
        offsets=None if base.offsets is None else np.asarray(base.offsets),
        text=base.text,
        model=base.model_name,
        n_layers=int(base.attentions.shape[0]),
        n_heads=int(base.attentions.shape[1]),
        row=row,
        causal=is_causal(base.attentions),
        methods=views,
        similarity=similarity,
        skipped=skipped,
    )


def method_view(name: str, trace: Trace, row: Row, model: ModelLike | None = None) -> MethodView:
    """A `MethodView` of one registered method on a trace that holds what it needs (see the
    module docstring for what it contributes)."""
    view = _view_from_trace(get_method(name), trace, model)
    _add_summaries(view, trace, row)
    _add_diagnostics(view, trace)
    return view


def _missing_needs(spec: MethodSpec, trace: Trace, model: ModelLike | None) -> list[str]:
    """The needs of ``spec`` that neither ``trace`` nor ``model`` can serve."""
    missing = []
    for need in sorted(spec.needs - {"attentions"}):
        have = model is not None if need == "model" else getattr(trace, need, None) is not None
        if not have:
            missing.append(need)
    return missing


def _requested(methods: Sequence[str] | None) -> list[str]:
    if methods is None:
        return available_methods()
    names = list(dict.fromkeys(methods))
    if not names:
        raise InputError("no methods to explore")
    for name in names:
        get_method(name)  # unknown names fail here, before any work
    return names


def _view_from_trace(spec: MethodSpec, trace: Trace, model: ModelLike | None = None) -> MethodView:
    n = trace.n_tokens
    layerwise = {"layerwise": True} if spec.layerwise else {}
    scores, _ = split(call_method(spec, trace, model=model, **layerwise))  # the explorer shows no extras
    result = np.asarray(scores, dtype=np.float64)
    if spec.scores_only:
        if result.shape != (n,):
            raise ValueError(f"method {spec.name!r} returned shape {result.shape}; expected one score per token ({n},)")
        return MethodView(
            spec.name,
            spec.summary,
            scores=result,
            note="attribution-only: one score per token, no matrix",
            signed=spec.signed,
        )
    if layerwise:
        matrices = result  # [layer, query, key]
        first_layer = trace.attentions.shape[0] - matrices.shape[0]
    else:
        matrices, first_layer = result[None], None  # [1, query, key]
    if matrices.ndim != 3 or matrices.shape[1:] != (n, n):
        raise ValueError(f"method {spec.name!r} returned shape {result.shape}; expected [(layer,) query, key]")
    head_matrices = None
    if spec.per_head:
        per_head = np.asarray(
            split(call_method(spec, trace, model=model, head_fusion="none", **layerwise))[0], dtype=np.float64
        )
        head_matrices = per_head if layerwise else per_head[None]  # [view, head, query, key]
        if head_matrices.shape[0] != matrices.shape[0] or head_matrices.shape[2:] != (n, n):
            raise ValueError(f"method {spec.name!r} returned per-head shape {per_head.shape}")
    return MethodView(spec.name, spec.summary, matrices=matrices, head_matrices=head_matrices, first_layer=first_layer)


def _add_summaries(view: MethodView, trace: Trace, row: Row) -> None:
    explained = subject(None if view.matrices is None else row, trace.tokens, trace.target)

    def sentence(scores: np.ndarray) -> str:
        found = summarize(trace.tokens, scores, explained, trace.special_mask, trace.text, trace.offsets)
        return baseline_prefix(view.name) + found

    if view.matrices is None:
        assert view.scores is not None  # an attribution-only view holds its scores
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


def _progress(specs: list[MethodSpec], show: bool) -> Any:
    if not show:
        return specs
    from tqdm import tqdm

    return tqdm(specs, desc="methods", unit="method", file=sys.stderr)
