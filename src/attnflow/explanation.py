"""`Explanation`: a method's relevance matrix with the tokens it explains, and `explain()`.

An Explanation knows how to show itself (`to_html`, `plot`, `_repr_html_` in notebooks) and how
to save itself (`save(dir)`: ``explanation.json``, ``explanation.html``, ``explanation.png`` and,
for images, ``explanation_overlay.png``). It holds no model and no method math: `explain`
looks the method up in the registry, runs it on a `Trace` and picks the saliency row.

    trace = attnflow.load("minilm").trace("The movie was terrible, but the acting was great.")[0]
    explanation = attnflow.explain(trace, method="rollout", row="mean", discard_ratio=0.5)
    explanation.save("out/")
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from attnflow.errors import ExplanationWarning, InputError, PrecisionWarning, warn_once
from attnflow.methods.diagnostics import collapse_note, is_causal
from attnflow.methods.extras import split
from attnflow.methods.registry import MethodSpec, call_method, get_method, method_options
from attnflow.methods.saliency import Row, parse_row, saliency_row, to_patch_grid
from attnflow.model_like import ModelLike
from attnflow.notebook import current_cell
from attnflow.staging import staged_output
from attnflow.trace import Trace

JSON_FILE = "explanation.json"
HTML_FILE = "explanation.html"
PNG_FILE = "explanation.png"
OVERLAY_FILE = "explanation_overlay.png"
OUTPUT_FILES = (JSON_FILE, HTML_FILE, PNG_FILE, OVERLAY_FILE)

# How an Explanation shows itself: "html" (page), "fragment" (notebook), "figure" (matplotlib),
# "overlay" (image). The views live in attnflow.viz and read Explanations, so this module imports
# none of them; the package root (attnflow/__init__.py) fills this table, loading them on first use.
_VIEWS: dict[str, Callable[..., Any]] = {}
# How ``method="auto"`` is resolved for `AttentionModel.explain`: "plan" (model, methods, options,
# target_text) -> the plan of the methods to run, "explain" (model, trace, plan, row) -> the
# explanations asked for, auto's choice with its ``chosen_by``. They are `attnflow.evaluate.per_input`'s
# (`plan_methods`, `explain_planned`: what `attnflow explain` runs), which builds on the model and
# this module; the package root fills this table, loading them on first use.
_AUTO: dict[str, Callable[..., Any]] = {}


CLEAR_MARGIN = 0.5  # comprehensiveness above random by half of random's (and by 0.01 of p) or more: "clear"
CLEAR_SHARE = 0.5  # with the input's bounds: "clear" closes half the way from random rankings to the best ranking
# Deletion separates nothing on an input whose rankings all drop p alike: the bounds' span under
# INDISTINCT_SPAN of p (or 0.01), random rankings at INDISTINCT_RANDOM of the way from the worst ranking
# to the best, or the best within one standard deviation of single random rankings above their mean.
INDISTINCT_SPAN = 0.05
INDISTINCT_RANDOM = 0.9
LEVEL_NOTES = {
    "clear": "",
    "marginal": " Barely above random rankings on this input (less than half the way from their drop to the best "
    "ranking's, or, where the input's bounds are not known, less than 1.5 times their drop).",
    "weak": " No better than random rankings on this input.",
    "indistinct": " Deletion cannot tell rankings apart on this input: every ranking drops p about as much as "
    "any other, so this map is neither confirmed nor refuted here.",
}


@dataclass(frozen=True)
class Separation:
    """What deletion can show on one input: the random rankings' mean AOPC comprehensiveness
    ``chance``, the standard deviation of single random rankings' (``spread``; 0 with fewer than
    two recorded) and the input's ``bounds`` (lowest, highest AOPC any ranking reaches), None
    where they were not computed."""

    chance: float
    spread: float
    bounds: tuple[float, float] | None

    @classmethod
    def of(cls, faithfulness: dict[str, Any]) -> Separation:
        """From a per-input faithfulness record (`attnflow.evaluate.per_input.input_faithfulness`)."""
        chance = faithfulness["random"]
        draws = chance.get("draws") or []
        spread = float(np.std(draws, ddof=1)) if len(draws) > 1 else 0.0
        found = (faithfulness.get("bounds") or {}).get("comprehensiveness") or [None, None]
        known = all(value is not None and np.isfinite(value) for value in found)
        return cls(
            float(chance["aopc_comprehensiveness"]), spread, (float(found[0]), float(found[1])) if known else None
        )

    def indistinct(self, probability: float) -> bool:
        """Whether no ranking can stand out on this input (`INDISTINCT_SPAN`, `INDISTINCT_RANDOM`)."""
        if self.bounds is None:
            return False
        lower, upper = self.bounds
        span = upper - lower
        if span < max(INDISTINCT_SPAN * abs(probability), 0.01):
            return True
        return (self.chance - lower) / span >= INDISTINCT_RANDOM or upper - self.chance <= self.spread


def faithfulness_level(faithfulness: dict[str, Any]) -> str:
    """How a per-input faithfulness record's comprehensiveness compares with what random rankings
    reach on the same input (`Separation`): ``"indistinct"`` when deletion cannot tell rankings
    apart there (every ranking drops p alike: a short input whose prediction falls whichever token
    goes); ``"weak"`` when it is no higher than random rankings' mean plus one standard deviation
    of single random rankings; ``"marginal"`` when it closes less than `CLEAR_SHARE` of the way
    from random rankings to the best ranking the input's bounds found (where there are no bounds:
    exceeds random's by less than `CLEAR_MARGIN` of it, by less than 0.01, or by less than two
    standard deviations); ``"clear"`` otherwise. The badge's colour and ``auto``'s warning both
    read it, so neither says more than the other."""
    mine = float(faithfulness["aopc_comprehensiveness"])
    separation = Separation.of(faithfulness)
    chance, spread = separation.chance, separation.spread
    if separation.indistinct(float(faithfulness.get("probability", 1.0))):
        return "indistinct"
    if mine <= chance + spread:
        return "weak"
    if separation.bounds is not None:
        upper = max(separation.bounds[1], mine)
        return "marginal" if mine - chance < CLEAR_SHARE * (upper - chance) else "clear"
    if mine - chance < max(CLEAR_MARGIN * chance, 0.01, 2 * spread):
        return "marginal"
    return "clear"


@dataclass
class Explanation:
    """Relevance of every input token for every output position, and the saliency row shown.

    Attributes:
        tokens: ``n`` token strings.
        matrix: ``[query, key]`` final relevance matrix of the method (e.g. the rollout R), or
            None for attribution-only methods (gradients, leave-one-out, ...), which give one
            score per token and no matrix, and when only the saliency row was computed
            (attention flow on an image, see `explain`; ``row`` then names it).
        scores: ``[key]`` saliency scores: the row of ``matrix`` named by ``row``, or the
            attribution-only method's scores.
        method: registry name of the method (``"rollout"``, ``"raw"``, ...).
        options: the method's options as used, defaults included (JSON-serialisable).
        row: ``"cls"``, ``"mean"``, ``"last"`` or a query index; None without a matrix.
        model: the model name the trace came from.
        text: the input text ("" for images).
        offsets: ``[n, 2]`` character spans into ``text`` (``(0, 0)`` for special tokens), or None.
        special_mask: ``[n]`` bool, True for special tokens, or None.
        grid: ``(rows, cols)`` patch grid for vision models, else None.
        n_prefix_tokens: tokens before the first patch (CLS, distillation, registers).
        image: path of the explained image, or None.
        image_box: ``(left, top, right, bottom)``: the region of the image (original pixels) that
            the patch grid covers (a centre crop, for example), or None for the whole image.
        head_matrices: ``[head, query, key]`` per-head matrices when the method kept heads apart
            (``head_fusion="none"``; ``matrix`` is then their mean), else None. Not saved to JSON.
        target: what a target-dependent method explained, ``{"kind", "index", "label", "value",
            "probability"}`` (see `attnflow.targets.ResolvedTarget`), else None.
        notes: what was warned about while capturing the input (truncation, mostly unknown
            tokens, an image converted to RGB: the Trace's ``meta["notes"]``) and while computing
            this explanation (e.g. pruning that left only the diagonal); saved to JSON and shown
            on the page.
        extras: numbers the method returned about this explanation besides its scores
            (`attnflow.methods.extras.Scored`; LRP: ``conservation``, ``bias_share``); saved to JSON.
        signed: the scores are signed (> 0 supports the target, < 0 speaks against it): the
            views colour the two signs apart; False: scores ≥ 0 (relevance, shares, norms).
        faithfulness: comprehensiveness and sufficiency of this explanation's ranking on this
            input and of random rankings (`attnflow.evaluate.per_input.input_faithfulness`), or None.
        chosen_by: why ``--method auto`` showed this explanation (its per-input comprehensiveness
            against the other candidates'), or None.
    """

    tokens: list[str]
    matrix: np.ndarray | None
    scores: np.ndarray
    method: str
    options: dict[str, Any]
    row: Row | None
    model: str = ""
    text: str = ""
    offsets: np.ndarray | None = None
    special_mask: np.ndarray | None = None
    grid: tuple[int, int] | None = None
    n_prefix_tokens: int = 0
    image: str | None = None
    head_matrices: np.ndarray | None = None
    target: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    image_box: tuple[float, float, float, float] | None = None
    notes: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    signed: bool = False
    faithfulness: dict[str, Any] | None = None
    chosen_by: str | None = None
    # The notebook cell it was made in and the notes said on stderr there: its notebook view does not
    # repeat them in that cell (`attnflow.notebook.current_cell`; None outside a notebook). Not saved.
    said_in_cell: int | None = field(default=None, repr=False, compare=False)
    said: list[str] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = [str(token) for token in self.tokens]
        n = len(self.tokens)
        self.scores = np.asarray(self.scores, dtype=np.float64)
        if self.matrix is not None:
            self.matrix = np.asarray(self.matrix, dtype=np.float64)
        if self.matrix is not None and self.matrix.shape != (n, n):
            raise ValueError(f"matrix must be [query, key] = ({n}, {n}) for {n} tokens, got {self.matrix.shape}")
        if self.scores.shape != (n,):
            raise ValueError(f"scores must have one entry per token ({n}), got shape {self.scores.shape}")
        if self.offsets is not None:
            self.offsets = np.asarray(self.offsets, dtype=np.int64).reshape(n, 2)
        if self.special_mask is not None:
            self.special_mask = np.asarray(self.special_mask, dtype=bool).reshape(n)
        if self.grid is not None:
            self.grid = (int(self.grid[0]), int(self.grid[1]))
        if self.image_box is not None:
            left, top, right, bottom = (float(edge) for edge in self.image_box)
            self.image_box = (left, top, right, bottom)

    def __repr__(self) -> str:
        """One line (the matrix is for `to_dict` and the pages): method, model, row, size, top tokens."""
        top = ", ".join(f"{token!r} {score:.3f}" for _, token, score in self.top(3))
        row = f", row={self.row!r}" if self.row is not None else ""
        return f"Explanation(method={self.method!r}, model={self.model!r}{row}, n_tokens={self.n_tokens}, top=[{top}])"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def patch_scores(self) -> np.ndarray | None:
        """``[rows, cols]`` scores of the image patches (prefix tokens dropped), or None for text."""
        if self.grid is None:
            return None
        return to_patch_grid(self.scores, self.grid, self.n_prefix_tokens)

    def summary(self) -> str:
        """One plain-language sentence: the words that carry most of the relevance, and their share."""
        from attnflow.methods.summary import explanation_summary

        return explanation_summary(self)

    def top(self, k: int = 10, include_special: bool = False) -> list[tuple[int, str, float]]:
        """The ``k`` highest-scoring tokens as ``(index, token, score)``, best first (signed
        scores rank by their signed value: the strongest support first)."""
        order = np.argsort(-self.scores, kind="stable")
        if not include_special and self.special_mask is not None:
            order = order[~self.special_mask[order]]
        return [(int(i), self.tokens[i], float(self.scores[i])) for i in list(order)[:k]]

    def against(self, k: int = 10) -> list[tuple[int, str, float]]:
        """The ``k`` most negative non-special tokens as ``(index, token, score)``, most negative
        first (signed explanations: the evidence against the target); only scores below 0."""
        order = np.argsort(self.scores, kind="stable")
        if self.special_mask is not None:
            order = order[~self.special_mask[order]]
        return [(int(i), self.tokens[i], float(self.scores[i])) for i in order[:k] if self.scores[i] < 0]

    # ----- showing -----------------------------------------------------------------------------

    def to_html(self) -> str:
        """A self-contained offline HTML page (no scripts, figures embedded as base64 PNG)."""
        return _VIEWS["html"](self)

    def _repr_html_(self) -> str:
        """In a notebook: the fragment of the page; the warnings said above in this same cell are
        counted, not repeated (the saved page keeps them all)."""
        from attnflow.notebook import current_cell

        same_cell = self.said_in_cell is not None and self.said_in_cell == current_cell()
        return _VIEWS["fragment"](self, said_above=self.said if same_cell else [])

    def plot(self) -> Any:
        """A matplotlib Figure: token scores (or the image overlay) above the matrix heatmap."""
        return _VIEWS["figure"](self)

    def overlay(self) -> Any:
        """The patch-grid saliency blended over the image (a PIL image); images only."""
        if self.image is None or self.grid is None:
            raise ValueError("an overlay needs an image explanation (an image path and a patch grid)")
        return _VIEWS["overlay"](self.image, self.patch_scores, box=self.image_box)

    # ----- saving ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable content of ``explanation.json``."""
        data: dict[str, Any] = {
            "model": self.model,
            "method": self.method,
            "options": _jsonable(self.options),
            "tokens": list(self.tokens),
            "row": self.row,
            "scores": self.scores.tolist(),
            "matrix": None if self.matrix is None else self.matrix.tolist(),
            "text": self.text,
        }
        if self.target is not None:
            data["target"] = _jsonable(self.target)
        if self.prediction is not None:
            data["prediction"] = _jsonable(self.prediction)
        if self.offsets is not None:
            data["offsets"] = self.offsets.tolist()
        if self.special_mask is not None:
            data["special_mask"] = self.special_mask.tolist()
        if self.grid is not None:
            data["grid"] = list(self.grid)
            data["n_prefix_tokens"] = self.n_prefix_tokens
            data["patch_scores"] = to_patch_grid(self.scores, self.grid, self.n_prefix_tokens).tolist()
        if self.image is not None:
            data["image"] = str(self.image)
        if self.image_box is not None:
            data["image_box"] = list(self.image_box)
        if self.notes:
            data["notes"] = list(self.notes)
        if self.extras:
            data["extras"] = _jsonable(self.extras)
        if self.signed:
            data["signed"] = True
        if self.faithfulness is not None:
            data["faithfulness"] = _jsonable(self.faithfulness)
        if self.chosen_by is not None:
            data["chosen_by"] = self.chosen_by
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Explanation":
        """Rebuild an Explanation from `to_dict` output (``patch_scores`` is derived, not read)."""
        return cls(
            tokens=list(data["tokens"]),
            matrix=None if data.get("matrix") is None else np.asarray(data["matrix"], dtype=np.float64),
            scores=np.asarray(data["scores"], dtype=np.float64),
            method=data["method"],
            options=dict(data.get("options", {})),
            row=data["row"],
            model=data.get("model", ""),
            text=data.get("text", ""),
            offsets=data.get("offsets"),
            special_mask=data.get("special_mask"),
            grid=tuple(data["grid"]) if data.get("grid") is not None else None,
            n_prefix_tokens=int(data.get("n_prefix_tokens", 0)),
            image=data.get("image"),
            target=data.get("target"),
            prediction=data.get("prediction"),
            image_box=data.get("image_box"),
            notes=list(data.get("notes", [])),
            extras=dict(data.get("extras", {})),
            signed=bool(data.get("signed", False)),
            faithfulness=data.get("faithfulness"),
            chosen_by=data.get("chosen_by"),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Explanation":
        """Read ``explanation.json`` (give the file or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / JSON_FILE
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def save(self, directory: str | Path, overwrite: bool = False) -> dict[str, Path]:
        """Write ``explanation.json``, ``.html``, ``.png`` (and ``explanation_overlay.png`` for
        images) into ``directory``, creating it. A folder that already holds an explanation is
        replaced only with ``overwrite=True`` (FileExistsError otherwise), all its explanation
        files at once; nothing else in the folder is touched. Returns ``{kind: path}``."""
        directory = Path(directory)
        with staged_output(directory, _is_explanation_file, overwrite) as scratch:
            paths = self.write_files(scratch)
        return {kind: directory / path.name for kind, path in paths.items()}

    def write_files(self, directory: Path) -> dict[str, Path]:
        """The files of `save`, written straight into ``directory`` (created), with no check and no
        temporary folder: for a folder that is itself being staged (the CLI's output folder)."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = {"json": directory / JSON_FILE, "html": directory / HTML_FILE, "png": directory / PNG_FILE}
        paths["json"].write_text(self.to_json(), encoding="utf-8")
        paths["html"].write_text(self.to_html(), encoding="utf-8")
        self.plot().savefig(paths["png"], dpi=110, bbox_inches="tight")
        if self.image is not None and self.grid is not None:
            paths["overlay"] = directory / OVERLAY_FILE
            self.overlay().save(paths["overlay"])
        return paths


def _is_explanation_file(name: str) -> bool:
    return name in OUTPUT_FILES


def explain(
    trace: Trace,
    method: str = "rollout",
    row: Row | None = None,
    model: ModelLike | None = None,
    *,
    check_collapse: bool = True,
    **options: Any,
) -> Explanation:
    """Run a registered method on a trace and wrap the result as an `Explanation`.

    Args:
        trace: the captured data of one input; it must hold what the method needs (see
            ``get_method(method).needs``; `AttentionModel.explain` captures exactly that).
        method: a name from `attnflow.available_methods()`.
        row: saliency row: ``"cls"``, ``"mean"``, ``"last"`` or a query index; None picks
            `default_row(trace)`. Ignored by attribution-only methods (no matrix).
        model: the `AttentionModel`, for methods that re-run it (leave-one-out, value zeroing,
            integrated gradients).
        check_collapse: note (and warn, once per run) when the saliency row collapses on one
            token (`attnflow.methods.diagnostics.collapse_note`, naming the method); False for a
            caller that checks the rows it reads itself (a generation: each step's row).
        **options: options of the method (see its ``MethodSpec.options``). Options the method
            does not declare raise ValueError; options given as None mean "the default".

    Methods are called as their declaration says (``MethodSpec.takes``); they return
    ``[query, key]``, ``[head, query, key]`` when heads stay apart (the Explanation's matrix is
    then the mean over heads and ``head_matrices`` keeps them), or ``[key]`` scores for
    attribution-only methods.

    On an image, a method that can compute selected output rows (``MethodSpec.rows``: attention flow)
    computes only the saliency row when that is one position (``cls``, ``last``, an index): the
    full flow matrix of a 16 × 16 grid (257 tokens) takes minutes, its CLS row about a second.
    The Explanation's ``matrix`` is then None, ``row`` names the row and ``options["rows"]``
    records it.
    """
    spec = get_method(method)
    chosen = method_options(spec, options)
    n = trace.n_tokens
    if trace.grid is not None and spec.rows:
        row = parse_row(default_row(trace) if row is None else row)
        position = _single_position(row, n)
        if position is not None:
            chosen = {**chosen, "rows": [position]}
            found, notes = run_noting_warnings(lambda: call_method(spec, trace, model=model, **chosen))
            scores, extras = split(found)
            row_scores = np.asarray(scores, dtype=np.float64).reshape(n)  # [1, n]: the one row computed
            return _explanation(trace, spec, chosen, row, None, row_scores, None, notes, extras, model, check_collapse)
    found, notes = run_noting_warnings(lambda: call_method(spec, trace, model=model, **chosen))
    found, extras = split(found)
    result = np.asarray(found, dtype=np.float64)
    head_matrices = None
    if spec.scores_only:
        matrix, scores, row = None, _token_scores(spec, result, n), None
    else:
        if result.ndim == 3 and result.shape[1:] == (n, n):
            head_matrices = result  # [head, query, key]
            result = result.mean(axis=0)
        if result.shape != (n, n):
            raise ValueError(f"method {method!r} returned shape {result.shape}; expected [query, key] = ({n}, {n})")
        row = parse_row(default_row(trace) if row is None else row)
        matrix, scores = result, saliency_row(result, row)
    return _explanation(trace, spec, chosen, row, matrix, scores, head_matrices, notes, extras, model, check_collapse)


def explain_traces(
    traces: Sequence[Trace],
    method: str,
    row: Row | None = None,
    model: ModelLike | None = None,
    *,
    check_collapse: bool = True,
    **options: Any,
) -> list[Explanation]:
    """`explain` for each of ``traces``; a method with a batch form (``MethodSpec.batch``: the LRP
    rules, leave-one-out) runs once over all of them instead of once per trace. A warning the
    batch raises becomes a note of every explanation of the batch."""
    spec = get_method(method)
    batch = spec.batch
    if batch is None or len(traces) < 2:
        return [
            explain(trace, method=method, row=row, model=model, check_collapse=check_collapse, **options)
            for trace in traces
        ]
    chosen = method_options(spec, options)
    results, notes = run_noting_warnings(lambda: batch(model, list(traces), **chosen))
    return [
        _explanation(
            trace,
            spec,
            chosen,
            None,
            None,
            _token_scores(spec, scores, trace.n_tokens),
            None,
            notes,
            extras,
            model,
            check_collapse,
        )
        for trace, (scores, extras) in zip(traces, map(split, results), strict=True)
    ]


def _token_scores(spec: MethodSpec, result: Any, n: int) -> np.ndarray:
    """A ``scores_only`` method's ``[n]`` scores, checked."""
    scores = np.asarray(result, dtype=np.float64)
    if scores.shape != (n,):
        raise ValueError(f"method {spec.name!r} returned shape {scores.shape}; expected one score per token ({n},)")
    return scores


def _explanation(
    trace: Trace,
    spec: MethodSpec,
    chosen: dict[str, Any],
    row: Row | None,
    matrix: np.ndarray | None,
    scores: np.ndarray,
    head_matrices: np.ndarray | None,
    notes: list[str],
    extras: dict[str, Any],
    model: ModelLike | None = None,
    check_collapse: bool = True,
) -> Explanation:
    image = trace.meta.get("image")
    cell = current_cell()
    captured_here = cell is not None and trace.meta.get("notes_cell") == cell  # its notes were said in this cell
    collapse = (
        None
        if spec.scores_only or not check_collapse
        else collapse_note(
            scores,
            list(trace.tokens),
            None if row is None else _single_position(row, trace.n_tokens),
            trace.special_mask,
            family=getattr(model, "adapter", None),
        )
    )
    if collapse:  # on the console too (once per run, `attnflow.errors.once_per_run`), naming the method
        collapse = f"{spec.name}: {collapse}"
        warn_once(collapse, about=spec.name, stacklevel=3)
    precision = low_precision_note(spec, trace.meta.get("dtype"))
    if precision:
        warn_once(precision, PrecisionWarning, about=spec.name, stacklevel=3)
        notes = [*notes, precision]
    return Explanation(
        tokens=list(trace.tokens),
        matrix=matrix,
        scores=scores,
        method=spec.name,
        options={**spec.defaults, **chosen},
        row=row,
        model=trace.model_name,
        text=trace.text,
        offsets=trace.offsets if trace.grid is None else None,
        special_mask=trace.special_mask,
        grid=trace.grid,
        n_prefix_tokens=trace.n_prefix_tokens,
        image=str(image) if image else None,
        head_matrices=head_matrices,
        target=trace.target.to_dict() if trace.target is not None and spec.uses_target else None,
        prediction=trace.target.to_dict() if trace.target is not None else None,
        image_box=trace.meta.get("image_box"),
        notes=[*trace.meta.get("notes", ()), *notes, *([collapse] if collapse else [])],
        extras=extras,
        signed=spec.signed or bool(chosen.get("signed")),
        said_in_cell=cell,
        said=[*(trace.meta.get("notes", ()) if captured_here else ()), *notes, *([collapse] if collapse else [])],
    )


def low_precision_note(spec: MethodSpec, dtype: str | None) -> str | None:
    """The warning for ``spec`` on a model that ran in ``dtype`` (a trace's ``meta["dtype"]``: None
    or ``"float32"`` for full precision), when its declaration flags it as untrustworthy in 16 bits
    (``MethodSpec.low_precision``); None otherwise."""
    if not dtype or dtype == "float32" or not spec.low_precision:
        return None
    return (
        f"{spec.name} on a model loaded in {dtype}: {spec.low_precision}; do not trust this map, load the model in "
        "float32 for it (docs/precision.md)"
    )


def run_noting_warnings(call: Any, say: bool = True) -> tuple[Any, list[str]]:
    """Run a method (a no-argument callable) and return its result; warnings it raises still go
    out as warnings, and the messages of `ExplanationWarning`s come back as the Explanation's notes
    (so the saved page says what the console said). ``say=False``: the `ExplanationWarning`s only
    come back (a method the user did not ask for: `attnflow.exploration.explore`'s defaults)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    for warning in caught:
        if say or not issubclass(warning.category, ExplanationWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result, [str(w.message) for w in caught if issubclass(w.category, ExplanationWarning)]


def default_row(trace: Trace) -> Row:
    """The natural saliency row for a trace (docs/methods.md, "Saliency row").

    In order: ``trace.meta["default_row"]`` when capture recorded one (e.g. ``"mean"`` for
    sentence encoders); images: ``"cls"`` when the model has prefix tokens, else ``"mean"``;
    causal (lower-triangular) attention: ``"last"``; otherwise ``"cls"``.
    """
    if trace.meta.get("default_row") is not None:
        return parse_row(trace.meta["default_row"])
    if trace.grid is not None:
        return "cls" if trace.n_prefix_tokens > 0 else "mean"
    if is_causal(trace.attentions):
        return "last"
    return "cls"


def _single_position(row: Row, n: int) -> int | None:
    """The query index a saliency row names (``cls`` 0, ``last`` n - 1, an index), or None for ``mean``."""
    if row == "mean":
        return None
    index = (0 if row == "cls" else n - 1) if isinstance(row, str) else int(row)
    if not -n <= index < n:
        raise InputError(f"{{row}} index {row} is out of range for {n} tokens", parameter="row")
    return index % n


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value
