"""`patch`: which sites of a model carry its prediction, by exact activation patching and the
approximations checked against it, on one pair of inputs (a clean text and its corruption).

The corruption is a counterfactual text of the same token length, or Gaussian noise on the word
embeddings of chosen words (ROME's causal tracing: N(0, (3σ)²), σ the std of the embedding matrix,
``samples`` seeded draws averaged). Normalised effects, with m the metric, x the clean and x̃ the
corrupted input:

- denoising (run x̃, restore the site's clean value): (m_patched − m_x̃) / (m_x − m_x̃), 1 = the
  site alone restores the answer;
- noising (run x, give the site its corrupted value): (m_x − m_patched) / (m_x − m_x̃), 1 = the
  site alone destroys the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from attnflow.causal.labels import FINAL_ROW_NOTE, layer_label, strongest_sites
from attnflow.causal.sites import (
    SITE_KINDS,
    SweepOptions,
    all_sites,
    check_sites_supported,
    parse_site_kinds,
    site_kind,
    sweep_shape,
)
from attnflow.errors import InputError, PatchingWarning, warn_once
from attnflow.methods.agreement import spearman
from attnflow.model_like import ModelLike
from attnflow.statistics import weighted_pearson, weighted_spearman
from attnflow.targets import legacy_target

if TYPE_CHECKING:
    from attnflow.causal.patching import BaseRun, PatchRunner

METHODS = ("exact", "atp", "atp*", "relp", "atp-ig")
DIRECTIONS = ("denoising", "noising")
NOISE_SCALE = 3.0  # ROME: noise std = 3 × the std of the embedding matrix
# The sampled check of the estimates (`check_design`): exact patches of this many sites per site
# kind, a third of them the estimates' strongest, the rest a seeded random draw, each drawn site
# weighted by the sites it stands for. The size: for the sample's r to land within 0.1 of the r
# over every site with 80 % chance where r is 0.7 (the threshold, where the answer matters), its
# standard error (1 − r²) / √(n − 1) must be at most 0.1 / 1.28: n ≥ 44; 48 sites of 4 kinds are
# the same 6 forward passes of 32 rows as 44. An estimate whose weighted Pearson r with exact on
# the sample is below CHECK_THRESHOLD gets a warning (docs/causal.md: by the Fisher interval of r
# over 48 sites, an estimate whose r over every site is 0.9 lands below 0.7 far less than once in
# 300 draws; the pairs where the estimates go wrong have r of 0.4–0.6).
CHECK_SITES = 48
CHECK_THRESHOLD = 0.7


@dataclass
class PatchResult:
    """Effects of patching every site, per method and site kind.

    ``effects[method][kind]``: normalised effects (module docstring), ``residual [n_layers + 1,
    token]`` (row 0: the stream entering the first layer, row l + 1: leaving layer l), ``attn`` and
    ``mlp [n_layers, token]``, ``heads [n_layers, head]`` (a head patched at every position, or at
    ``head_position`` only), ``experts [n_layers, expert]`` (exact only, rows with a mixture of
    experts: an expert's part patched at every position; a shared expert last), ``knockout
    [n_layers, key position]`` (exact only; the edge key →
    ``knockout_target`` blocked in ``knockout_window`` layers centred on each layer; NaN in columns
    outside ``knockout_sources``).
    ``clean_metric`` m_x and ``corrupt_metric`` m_x̃ (the mean over noise samples); ``seconds``: the
    time each method took (the two runs that cache activations are ``"cache"``).
    ``check``: the sampled check of the estimates (empty without one): ``sites {kind: [[row,
    column], ...]}`` (`check_design`: ``size`` a kind, ``strongest`` of them the estimates'
    strongest, the rest drawn with ``seed``), ``weights {kind: [weight per site]}`` (1 for the
    strongest, the number of sites each drawn one stands for), ``exact {kind: [effect per site]}``,
    ``correlations {method: {kind: {"pearson", "spearman", "sites"}}}`` (weighted), the warning ``threshold``
    (`CHECK_THRESHOLD`), the ``seconds`` its exact patches took (about ``size × kinds /
    batch_size`` forward passes) and ``from_full_sweep`` (read from an exact sweep, at no cost).
    """

    model: str
    clean_text: str
    corrupt_text: str | None
    noise_words: list[str]
    tokens: list[str]
    corrupt_tokens: list[str]
    direction: str
    metric: str
    clean_metric: float
    corrupt_metric: float
    samples: int
    n_layers: int
    n_heads: int
    effects: dict[str, dict[str, np.ndarray]]
    seconds: dict[str, float] = field(default_factory=dict)
    head_position: int | None = None
    knockout_target: int | None = None
    knockout_window: int = 1
    knockout_sources: list[int] | None = None
    check: dict[str, Any] = field(default_factory=dict)
    token_mixers: bool = False  # a hybrid stack (`Adapter.mixers`): the attn sites are each layer's token mixer

    @property
    def options(self) -> SweepOptions:
        """The sweep's options (what each kind's sites were written at)."""
        sources = None if self.knockout_sources is None else tuple(self.knockout_sources)
        return SweepOptions(self.head_position, self.knockout_target, self.knockout_window, sources)

    @property
    def correlations(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{method: {kind: {"pearson": r, "spearman": ρ}}}`` of each approximation against
        exact patching over the sites of each kind (empty without an exact sweep)."""
        exact = self.effects.get("exact")
        if exact is None:
            return {}
        return {
            method: {kind: correlation(values, exact[kind]) for kind, values in effects.items() if kind in exact}
            for method, effects in self.effects.items()
            if method != "exact"
        }

    def to_dict(self) -> dict[str, Any]:
        """Every number, JSON-ready (arrays as nested lists)."""
        return {
            "model": self.model,
            "clean_text": self.clean_text,
            "corrupt_text": self.corrupt_text,
            "noise_words": self.noise_words,
            "tokens": self.tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "direction": self.direction,
            "metric": self.metric,
            "clean_metric": self.clean_metric,
            "corrupt_metric": self.corrupt_metric,
            "samples": self.samples,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "head_position": self.head_position,
            "knockout_target": self.knockout_target,
            "knockout_window": self.knockout_window,
            "knockout_sources": self.knockout_sources,
            "token_mixers": self.token_mixers,
            "effects": {
                method: {kind: values.tolist() for kind, values in effects.items()}
                for method, effects in self.effects.items()
            },
            "correlations": self.correlations,
            "check": self.check,
            "check_warnings": self.check_warnings,
            "seconds": self.seconds,
        }

    @property
    def check_warnings(self) -> list[str]:
        """One line per estimate and site kind whose Pearson r with exact patching on the sampled
        check (`check`) is below its threshold (empty without a check)."""
        if not self.check:
            return []
        threshold, lines = self.check["threshold"], []
        for method, kinds in self.check["correlations"].items():
            for kind, values in kinds.items():
                if values["pearson"] < threshold:
                    lines.append(
                        f"{method} agrees poorly with exact patching on {values['sites']} sampled {kind} sites "
                        f"(Pearson r {values['pearson']:.2f} < {threshold}): do not read its {kind} map as the "
                        f"patching effects; run --method exact (or patch(..., methods='exact')) on this pair"
                    )
        return lines

    def summary(self) -> str:
        """A few console lines: the metric on both inputs, the strongest sites, the
        approximations' agreement with exact patching and the time each took."""
        from attnflow.tokens import display_token

        lines = [
            f"{self.metric}: clean {self.clean_metric:.4g}, corrupted {self.corrupt_metric:.4g} ({self.direction})"
        ]
        for method, effects in self.effects.items():
            for kind, values in effects.items():
                layer, index = strongest_sites(kind, values, 1)[0]
                where = (
                    f"token {index} {display_token(self.tokens[index])!r}"
                    if site_kind(kind).column == "position"
                    else f"head {index}"
                )
                lines.append(
                    f"{method:>5} {kind:<8} strongest: {layer_label(kind, layer)}, {where}: {values[layer, index]:+.3f}"
                )
        if any("residual" in effects for effects in self.effects.values()):
            lines.append(f"(residual: {FINAL_ROW_NOTE}; emb: entering layer 0, Ln: leaving layer n)")
        for method, kinds in self.correlations.items():
            agreement = ", ".join(
                f"{kind} r={values['pearson']:.2f} rho={values['spearman']:.2f}" for kind, values in kinds.items()
            )
            lines.append(f"{method} vs exact: {agreement}")
        lines += self._check_lines()
        lines.append("seconds: " + ", ".join(f"{name} {value:.2f}" for name, value in self.seconds.items()))
        return "\n".join(lines)

    def warn(self) -> PatchResult:
        """Say each of `check_warnings` as a `PatchingWarning` (once per run of many pairs); returns itself."""
        for line in self.check_warnings:
            warn_once(line, PatchingWarning, about="patch", stacklevel=3)
        return self

    def _check_lines(self) -> list[str]:
        """The sampled check's lines of `summary`: its size and cost, each estimate's r and ρ with
        exact patching on it per site kind, and the warnings."""
        if not self.check:
            return []
        check = self.check
        cost = "read from the full exact sweep" if check["from_full_sweep"] else f"{check['seconds']:.2f} s"
        lines = [
            f"sampled check: exact patching of {check['size']} sites per kind ({check['strongest']} the estimates' "
            f"strongest, the rest drawn with seed {check['seed']}, each weighted by the sites it stands for; {cost}):"
        ]
        for method, kinds in check["correlations"].items():
            agreement = ", ".join(
                f"{kind} r={values['pearson']:.2f} rho={values['spearman']:.2f}" for kind, values in kinds.items()
            )
            lines.append(f"  {method} vs exact on the sample: {agreement}")
        lines += [f"warning: {line}" for line in self.check_warnings]
        return lines

    def __repr__(self) -> str:
        """One line (the arrays are for `to_dict` and the report): the model, the metric on both
        inputs, the methods and each site kind's shape."""
        methods = ", ".join(self.effects)
        shapes = ", ".join(
            f"{kind} {list(values.shape)}" for kind, values in next(iter(self.effects.values()), {}).items()
        )
        return (
            f"PatchResult(model={self.model!r}, {self.direction}, {self.metric}: clean {self.clean_metric:.4g}, "
            f"corrupted {self.corrupt_metric:.4g}; {methods}; {shapes})"
        )

    def _repr_html_(self) -> str:
        """In a notebook: the inputs, the metric and the strongest sites (`save` writes the heatmaps)."""
        from attnflow.causal.report import report_fragment

        return report_fragment(self)

    def save(self, out: str | Path) -> Path:
        """Write ``patch.json`` (every number) and ``patch.html`` (the report) into ``out``."""
        from attnflow.causal.report import write_report

        return write_report(self, Path(out))


def correlation(estimate: np.ndarray, exact: np.ndarray, weights: Any = None) -> dict[str, float]:
    """Pearson r and Spearman ρ of two arrays of the same shape over the sites both hold (NaN where
    a kind has none: a hybrid's heads outside its attention blocks; NaN when either is constant);
    ``weights`` (same shape): each element counted that many times (`check_design`'s weights)."""
    from scipy.stats import pearsonr

    a, b = np.ravel(estimate).astype(float), np.ravel(exact).astype(float)
    held = np.isfinite(a) & np.isfinite(b)
    a, b = a[held], b[held]
    weights = None if weights is None else np.ravel(np.asarray(weights, dtype=float))[held]
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return {"pearson": float("nan"), "spearman": float("nan")}
    if weights is not None:
        return {"pearson": weighted_pearson(a, b, weights), "spearman": weighted_spearman(a, b, weights)}
    return {"pearson": float(pearsonr(a, b)[0]), "spearman": spearman(a, b)}


def check_sample(estimates: dict[str, dict[str, np.ndarray]], size: int, seed: int) -> dict[str, list[tuple[int, int]]]:
    """The sites of the sampled check per site kind, ``[(row, column), ...]`` in row-major order
    (`check_design` without the weights)."""
    return {kind: sites for kind, (sites, _) in check_design(estimates, size, seed).items()}


def check_design(
    estimates: dict[str, dict[str, np.ndarray]], size: int, seed: int
) -> dict[str, tuple[list[tuple[int, int]], list[float]]]:
    """The sampled check's sites per site kind, ``[(row, column), ...]`` in row-major order, and
    each one's weight: ``size`` sites (every site when a kind has fewer), ⌈size / 3⌉ of them the
    estimates' strongest (by |effect|, the methods taken in turn: each estimate's first, then each
    one's second, …; weight 1, as they are always taken), the rest drawn at random (``seed``) from
    the N − k others, each weighted by the (N − k) / (size − k) sites it stands for (the inverse of
    its chance of being drawn), so that the weighted r over the sample estimates the r over every
    site instead of leaning to the strongest sites. ``estimates[method][kind]``: arrays of the same
    shape per kind (``[row, column]``; NaN where a kind has no site, which is never drawn)."""
    rng = np.random.default_rng(seed)
    chosen: dict[str, tuple[list[tuple[int, int]], list[float]]] = {}
    kinds = next(iter(estimates.values()), {})
    for kind, first in kinds.items():
        shape = first.shape
        present = np.flatnonzero(np.isfinite(first.ravel()))  # a hybrid's heads: its attention blocks' rows only
        n_sites = len(present)
        wanted = min(size, n_sites)
        rankings = [
            present[np.argsort(-np.abs(np.nan_to_num(effects[kind].ravel()[present])), kind="stable")]
            for effects in estimates.values()
        ]
        strongest: list[int] = []
        for rank in range(n_sites):
            for ranking in rankings:
                if len(strongest) < -(-wanted // 3) and int(ranking[rank]) not in strongest:
                    strongest.append(int(ranking[rank]))
            if len(strongest) >= -(-wanted // 3):
                break
        rest = np.setdiff1d(present, strongest)
        drawn = (
            rng.choice(rest, size=wanted - len(strongest), replace=False).tolist() if wanted > len(strongest) else []
        )
        stands_for = len(rest) / len(drawn) if drawn else 1.0  # [site] of the rest per drawn site
        flat = sorted(strongest + [int(index) for index in drawn])
        chosen[kind] = (
            [(index // shape[1], index % shape[1]) for index in flat],
            [1.0 if index in strongest else stands_for for index in flat],
        )
    return chosen


def parse_methods(methods: str | Sequence[str]) -> tuple[str, ...]:
    """``"exact,atp"`` or a sequence -> known patching methods in order, without repeats; ``relp:NAME``
    is RelP with the registered rule set NAME as its backward (``relp``: AttnLRP's)."""
    from attnflow.causal.approximations import relp_rules

    names = [name.strip() for name in (methods.split(",") if isinstance(methods, str) else methods) if name.strip()]
    unknown = [name for name in names if name not in METHODS and relp_rules(name) is None]
    if unknown or not names:
        raise InputError(
            f"unknown patching method(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(METHODS)} "
            "(relp:RULES for RelP with another registered rule set, e.g. relp:gim)"
        )
    return tuple(dict.fromkeys(names))


def patch(
    model: ModelLike,
    clean: str,
    corrupt: str | None = None,
    *,
    noise: str | Sequence[str] | None = None,
    target: Any = None,
    contrast: int | str | None = None,
    sites: str | Sequence[str] = SITE_KINDS,
    methods: str | Sequence[str] = ("exact", "atp"),
    direction: str = "denoising",
    samples: int = 10,
    seed: int = 0,
    batch_size: int = 32,
    head_position: int | None = None,
    knockout_target: int | None = None,
    knockout_window: int = 1,
    knockout_sources: Sequence[int] | None = None,
    progress: bool = True,
    check_sites: int = CHECK_SITES,
) -> PatchResult:
    """Patch every site of the kinds ``sites`` (`attnflow.causal.sites.ALL_KINDS`; default the
    activation kinds `SITE_KINDS`) between ``clean`` and its corruption, by each of ``methods``
    (``exact``, ``atp``, ``atp*``, ``relp``, ``atp-ig``; the approximations do not estimate the
    knockout, and are left out of a sweep of knockouts only).

    Args:
        model: an `AttentionModel` whose family has patching sites: a classifier or a causal LM.
        corrupt: a counterfactual text of the same token length as ``clean``; or
        noise: words of ``clean`` (a comma-separated string or a list) whose word embeddings get
            Gaussian noise, ``samples`` seeded draws averaged.
        target: what the metric reads, a `attnflow.targets.Target` (or a class or token, as `as_target`
            takes them; default: the clean prediction); with its contrast (``contrast=``: deprecated)
            the logit difference target − contrast, else the class logit or log p(token).
        direction: ``"denoising"`` (restore clean values into the corrupted run) or ``"noising"``.
        batch_size: rows per forward pass of the exact sweep (each row patches one site).
        head_position: patch each head at this position only (negative: from the end, -1 = the
            last); None: at every position.
        knockout_target, knockout_window, knockout_sources: where ``knockout`` blocks attention
            edges (`attnflow.rows.site_kinds`; `_sweep_options`). It runs on the clean input: its
            effect is (m_clean − m_blocked) / (m_clean − m_corrupted), in either direction.
        check_sites: with an estimate, patch this many sites a kind exactly (`check_sample`, seeded
            by ``seed``) and report its r with exact on them (`PatchResult.check`); 0: no check.

    Returns:
        a `PatchResult`; its arrays are ``[layer, position]`` per site kind, ``[layer, head]`` for heads.
    """
    check_sites_supported(model)
    kinds = parse_site_kinds(sites)
    chosen = parse_methods(methods)
    _check_request(model, chosen, direction, corrupt, noise, check_sites)
    clean_ids = _token_ids(model, clean, "clean")
    corruption = _corruption(model, clean, clean_ids, corrupt, noise, samples, seed)
    options = _sweep_options(
        model, clean_ids.shape[1], head_position, knockout_target, knockout_window, knockout_sources
    )
    metric = resolve_metric(model, clean_ids, legacy_target(target, None, contrast, "patch"))
    sweep = _Sweep(model, metric, kinds, direction, options, batch_size, progress, int(check_sites), seed)
    m_clean, m_corrupt, effects, seconds, check = sweep.run(chosen, clean_ids, corruption)
    tokenizer = model.tokenizer
    return PatchResult(
        model=model.name,
        clean_text=clean,
        corrupt_text=corrupt,
        noise_words=corruption.words,
        tokens=tokenizer.convert_ids_to_tokens(clean_ids[0].tolist()),
        corrupt_tokens=tokenizer.convert_ids_to_tokens(corruption.ids[0].tolist()),
        direction=direction,
        metric=metric.describe(),
        clean_metric=m_clean,
        corrupt_metric=m_corrupt,
        samples=corruption.rows,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        effects=effects,
        seconds=seconds,
        check=check,
        token_mixers=model.adapter.mixers is not None,
        **_options_fields(options, kinds),
    ).warn()


def _sweep_options(
    model: ModelLike,
    n_tokens: int,
    head_position: int | None,
    target: int | None,
    window: int,
    sources: Sequence[int] | None,
) -> SweepOptions:
    """The sweep's options, checked (positions: negative counts from the end). ``target``: the query
    whose edges the knockout blocks; None: the predicting position (0 for a model that reads its
    first token, else the last). ``window``: layers blocked around each layer (centred: layer −
    ⌊(w − 1)/2⌋ … layer + ⌊w/2⌋). ``sources``: the key positions swept; None: every position."""
    return SweepOptions(
        _position(head_position, n_tokens, "head_position"),
        _knockout_target(model, target, n_tokens),
        _positive(window, "knockout_window"),
        None if sources is None else _sources(sources, n_tokens),
    )


def _options_fields(options: SweepOptions, kinds: Sequence[str]) -> dict[str, Any]:
    """The `PatchResult` fields of the sweep's options (the knockout's only when it ran)."""
    fields: dict[str, Any] = {"head_position": options.head_position}
    if "knockout" in kinds:
        sources = None if options.sources is None else list(options.sources)
        fields.update(knockout_target=options.target, knockout_window=options.window, knockout_sources=sources)
    return fields


@dataclass(frozen=True)
class _Corruption:
    """The corrupted input: its token ids ``[1, token]``, the rows each forward pass runs (1, or
    ``samples`` noise draws), the noise added to the word embeddings (or None) and the noised words."""

    ids: Any
    rows: int
    noise: Any
    words: list[str]


def _corruption(
    model: ModelLike,
    clean: str,
    clean_ids: Any,
    corrupt: str | None,
    noise: str | Sequence[str] | None,
    samples: int,
    seed: int,
) -> _Corruption:
    """The counterfactual text (same token length as the clean one), or ``samples`` noise draws on the clean text."""
    if corrupt is None:
        words = _words(noise)
        return _Corruption(clean_ids, samples, noise_on_words(model, clean, words, samples, seed), words)
    return _Corruption(counterfactual_ids(model, clean_ids, corrupt), 1, None, [])


def counterfactual_ids(model: ModelLike, clean_ids: Any, corrupt: str) -> Any:
    """``[1, token]`` ids of the counterfactual text, refused (one line) unless it has the clean
    text's token length."""
    corrupt_ids = _token_ids(model, corrupt, "corrupt")
    if corrupt_ids.shape != clean_ids.shape:
        raise InputError(
            f"the clean text is {clean_ids.shape[1]} tokens and the corrupt text {corrupt_ids.shape[1]}: "
            "patching needs the same token length; choose a counterfactual of the same length, or "
            "corrupt the clean text with noise on some of its words ({noise})",
            parameter=("corrupt", "noise"),
        )
    return corrupt_ids


def _position(position: int | None, n_tokens: int, name: str) -> int | None:
    """A position option as an index from the start (negative counts from the end), checked."""
    if position is None:
        return None
    if not -n_tokens <= position < n_tokens:
        raise InputError(f"{name} {position} is outside the text's {n_tokens} tokens")
    return position % n_tokens


def _positive(value: int, name: str) -> int:
    if int(value) != value or value < 1:
        raise InputError(f"{name} must be a whole number of at least 1, got {value}")
    return int(value)


def _sources(sources: Sequence[int], n_tokens: int) -> tuple[int, ...]:
    """``knockout_sources`` as sorted positions from the start, checked."""
    positions = {_position(int(source), n_tokens, "knockout_sources") for source in sources}
    if not positions:
        raise InputError("knockout_sources names no position")
    return tuple(sorted(position for position in positions if position is not None))


def _knockout_target(model: ModelLike, target: int | None, n_tokens: int) -> int | None:
    """The knockout's query position: ``target`` checked, or the position the model predicts from
    (the first for a model that reads its first token, else the last)."""
    if target is not None:
        return _position(target, n_tokens, "knockout_target")
    return 0 if model.default_row == "cls" else n_tokens - 1


@dataclass
class _Sweep:
    """One patching run: both inputs' values cached once, then each method's effects on every site."""

    model: ModelLike
    metric: Any
    kinds: tuple[str, ...]
    direction: str
    options: SweepOptions
    batch_size: int
    progress: bool
    check_sites: int = 0
    seed: int = 0

    def run(
        self, methods: Sequence[str], clean_ids: Any, corruption: _Corruption
    ) -> tuple[float, float, dict[str, dict[str, np.ndarray]], dict[str, float], dict[str, Any]]:
        """(m_clean, m_corrupt, effects per method and site kind, seconds per step, the sampled
        check of the estimates (`PatchResult.check`; empty without one))."""
        import torch

        from attnflow.causal.approximations import estimable, estimate
        from attnflow.causal.patching import BaseRun, PatchRunner, stacked

        runner = PatchRunner(self.model, self.metric)
        runner.modules.check_kinds(self.kinds)
        started = time.perf_counter()
        with torch.no_grad():
            clean_metric, clean_recorded = runner.forward(clean_ids, 1, record=True)
            corrupt_metric, corrupt_recorded = runner.forward(
                corruption.ids, corruption.rows, noise=corruption.noise, record=True
            )
        seconds = {"cache": time.perf_counter() - started}
        m_clean, m_corrupt = float(clean_metric.double().mean()), float(corrupt_metric.double().mean())
        difference = m_clean - m_corrupt
        if abs(difference) < 1e-6:
            raise InputError(
                f"the corruption does not change the metric ({self.metric.describe()} = {m_clean:.4g} on both): "
                "nothing to restore; choose a corruption that changes the prediction"
            )
        warn_if_unreadable(self.metric, m_clean, m_corrupt)
        clean_run = BaseRun(clean_ids, None, {}, 1)
        corrupt_run = BaseRun(corruption.ids, corruption.noise, {}, corruption.rows)
        if self.direction == "denoising":
            source = clean_run.embeddings(runner)
            base = BaseRun(corruption.ids, corruption.noise, stacked(clean_recorded), corruption.rows, source)
            m_base, sign = m_corrupt, 1.0
        else:
            source = corrupt_run.embeddings(runner)
            base = BaseRun(clean_ids, None, stacked(corrupt_recorded), corruption.rows, source)
            m_base, sign = m_clean, -1.0
        # An intervention (knockout) runs on the clean input whatever the direction: its effect
        # reads like noising, (m_clean − m_intervened) / (m_clean − m_corrupted).
        interventions = BaseRun(clean_ids, None, {}, 1)

        def normalised(changes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {
                kind: (sign if site_kind(kind).is_activation else -1.0) * change / difference
                for kind, change in changes.items()
            }

        effects: dict[str, dict[str, np.ndarray]] = {}
        for method in methods:
            if method != "exact" and not estimable(self.kinds):
                continue  # an approximation with nothing to estimate (a knockout-only sweep)
            started = time.perf_counter()
            if method == "exact":
                changes = self._exact(runner, (base, m_base), (interventions, m_clean), clean_ids.shape[1])
            else:
                changes = estimate(method, runner, base, self.kinds, self.options.head_position)
            seconds[method] = time.perf_counter() - started
            effects[method] = normalised(changes)
        estimates = {method: values for method, values in effects.items() if method != "exact"}
        if not self.check_sites or not estimates:
            return m_clean, m_corrupt, effects, seconds, {}
        started = time.perf_counter()
        design = check_design(estimates, self.check_sites, self.seed)
        sample = {kind: sites for kind, (sites, _) in design.items()}
        exact = effects.get("exact")
        if exact is None:
            exact = normalised(
                self._exact(runner, (base, m_base), (interventions, m_clean), clean_ids.shape[1], sample)
            )
        check_seconds = time.perf_counter() - started
        check = _check(estimates, exact, design, self.check_sites, self.seed, check_seconds, "exact" in effects)
        return m_clean, m_corrupt, effects, seconds, check

    def _exact(
        self,
        runner: PatchRunner,
        patched: tuple[BaseRun, float],
        intervened: tuple[BaseRun, float],
        n_tokens: int,
        only: dict[str, list[tuple[int, int]]] | None = None,
    ) -> dict[str, np.ndarray]:
        """The metric's change when each site alone is patched, per site kind (exact activation
        patching): activation kinds on the ``patched`` run, interventions on the ``intervened`` one
        (each with the metric of its run unpatched). ``only``: the kinds and sites (row, column) to
        patch (the rest of each array NaN); None: every site of every kind."""
        from attnflow.causal.patching import exact_sweep

        model, n_experts = self.model, runner.modules.n_experts
        swept = self.kinds if only is None else tuple(only)
        sites = {
            kind: all_sites(
                kind,
                model.n_layers,
                n_tokens,
                model.n_heads,
                options=self.options,
                n_experts=n_experts,
                layers=runner.modules.rows(kind),
            )
            for kind in swept
        }
        if only is not None:
            sites = {
                kind: [site for site in every if (site.layer, site.index) in set(only[kind])]
                for kind, every in sites.items()
            }
        changes = {}
        with _progress_bar(sum(map(len, sites.values())), self.progress) as bar:
            for (base, m_base), activations in ((patched, True), (intervened, False)):
                kinds = [kind for kind in swept if site_kind(kind).is_activation == activations]
                chosen = [site for kind in kinds for site in sites[kind]]
                if not chosen:
                    continue
                metrics = exact_sweep(
                    runner, base.input_ids, base.noise, base.source, chosen, base.samples, self.batch_size, bar
                )
                start = 0
                for kind in kinds:
                    shape = sweep_shape(kind, model.n_layers, n_tokens, model.n_heads, n_experts)
                    changes[kind] = np.full(shape, np.nan)  # columns a sweep leaves out stay NaN
                    for site, metric in zip(sites[kind], metrics[start : start + len(sites[kind])], strict=True):
                        changes[kind][site.layer, site.index] = metric - m_base
                    start += len(sites[kind])
        return changes


def _check(
    estimates: dict[str, dict[str, np.ndarray]],
    exact: dict[str, np.ndarray],
    design: dict[str, tuple[list[tuple[int, int]], list[float]]],
    size: int,
    seed: int,
    seconds: float,
    from_full_sweep: bool,
) -> dict[str, Any]:
    """`PatchResult.check`: the sampled sites per kind and their weights (`check_design`), exact's
    effect on each, each estimate's weighted Pearson r and Spearman ρ with exact on them per kind,
    the threshold, the size, the seed, the seconds the exact patches took and whether they were
    read from a full exact sweep."""
    sample = {kind: sites for kind, (sites, _) in design.items()}
    correlations: dict[str, dict[str, dict[str, float | int]]] = {}
    for method, kinds in estimates.items():
        correlations[method] = {}
        for kind, (sites, weights) in design.items():
            rows, columns = np.array(sites, dtype=int).reshape(-1, 2).T
            values = correlation(kinds[kind][rows, columns], exact[kind][rows, columns], weights)
            correlations[method][kind] = {**values, "sites": len(sites)}
    return {
        "size": size,
        "strongest": -(-size // 3),
        "seed": seed,
        "threshold": CHECK_THRESHOLD,
        "seconds": seconds,
        "from_full_sweep": from_full_sweep,
        "sites": {kind: [list(site) for site in sites] for kind, sites in sample.items()},
        "weights": {kind: weights for kind, (_, weights) in design.items()},
        "exact": {kind: [float(exact[kind][row, column]) for row, column in sites] for kind, sites in sample.items()},
        "correlations": correlations,
    }


def _check_request(
    model: ModelLike, methods: Sequence[str], direction: str, corrupt: str | None, noise: Any, check_sites: int = 0
) -> None:
    """One line for a direction that does not exist, a corruption given twice or not at all, a
    sampled check of no whole number of sites, or a RelP method whose rule set the family cannot run."""
    if int(check_sites) != check_sites or check_sites < 0:
        raise InputError(
            f"check_sites must be a whole number of at least 0, got {check_sites}", parameter="check_sites"
        )
    if direction not in DIRECTIONS:
        raise InputError(f"unknown {{direction}} {direction!r}; choose denoising or noising", parameter="direction")
    if (corrupt is None) == (noise is None):
        raise InputError(
            "give either a corrupt text ({corrupt}) or words of the text to add noise to ({noise})",
            parameter=("corrupt", "noise"),
        )
    _check_relp(model, methods)


def _check_relp(model: ModelLike, methods: Sequence[str]) -> None:
    """One line when a RelP method's rule set needs what the model's family lacks."""
    from attnflow.causal.approximations import relp_rules
    from attnflow.methods.model.lrp import check_rules_supported

    for method in methods:
        rules = relp_rules(method)
        if rules is not None:
            check_rules_supported(model, rules, f"{method} (AtP with the {rules.name} backward)")


def _words(noise: str | Sequence[str] | None) -> list[str]:
    if noise is None:
        return []
    words = [word.strip() for word in (noise.split(",") if isinstance(noise, str) else noise) if word.strip()]
    if not words:
        raise InputError("{noise} needs at least one word of the text", parameter="noise")
    return words


def _token_ids(model: ModelLike, text: str, which: str) -> Any:
    """``[1, token]`` the text's token ids (special tokens included, as the model reads it)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"the {which} text is empty")
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] > model.max_length:
        raise InputError(f"the {which} text is {ids.shape[1]} tokens; {model.name} reads at most {model.max_length}")
    return ids


def noise_positions(model: ModelLike, text: str, words: Sequence[str]) -> list[int]:
    """The token positions of ``text`` that spell any occurrence of ``words`` (one clear line
    naming the words that do not occur)."""
    missing = [word for word in words if word not in text]
    if missing:
        raise InputError(f"noise word(s) {', '.join(repr(w) for w in missing)} do not occur in the text {text!r}")
    spans = []
    for word in words:
        start = text.find(word)
        while start >= 0:
            spans.append((start, start + len(word)))
            start = text.find(word, start + 1)
    offsets = model.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    positions = [
        position
        for position, (begin, end) in enumerate(offsets)
        if end > begin and any(begin < span_end and end > span_start for span_start, span_end in spans)
    ]
    if not positions:
        raise InputError(f"no token of {text!r} spells the noise word(s) {', '.join(words)}")
    return positions


def noise_on_words(model: ModelLike, text: str, words: Sequence[str], samples: int, seed: int) -> Any:
    """``[samples, token, d_model]`` Gaussian noise, std 3σ (σ: the std of the embedding matrix), on
    the positions of ``words`` and zero elsewhere; seeded."""
    import torch

    positions = noise_positions(model, text, words)
    n_tokens = _token_ids(model, text, "clean").shape[1]
    weight = model.hf_model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    noise = torch.zeros(samples, n_tokens, weight.shape[1])
    draws = torch.randn(samples, len(positions), weight.shape[1], generator=generator)
    noise[:, positions] = draws * NOISE_SCALE * float(weight.detach().float().std())
    return noise


def resolve_metric(model: ModelLike, clean_ids: Any, target: Any = None) -> Any:
    """The `Metric` for this model and the `attnflow.targets.Target` asked for (``target``: a Target,
    or a class or token as `as_target` takes it); default target: the clean input's prediction."""
    import torch

    from attnflow.causal.patching import Metric
    from attnflow.targets import as_target

    kind = model.target_kind
    if kind not in ("class", "next_token"):
        raise InputError(
            f"activation patching needs a classifier or a causal LM (a class or next-token metric); "
            f"{model.name} has {'no target' if kind is None else kind + ' targets'}"
        )
    objective = as_target(target).objective(model)
    chosen = objective.fixed_index
    if chosen is None:
        with torch.no_grad():
            logits = model.hf_model(input_ids=clean_ids.to(model.device)).logits
        chosen = int((logits[0, -1] if kind == "next_token" else logits[0]).argmax())
        if objective.contrast_index == chosen:
            raise InputError("the {contrast} is the target itself: choose another class or token", parameter="contrast")
    return Metric.of(objective, chosen)


def warn_if_unreadable(metric: Any, m_clean: float, m_corrupt: float) -> None:
    """One `PatchingWarning` line (said once per run of many pairs, `attnflow.errors.warn_once`) when
    the metric does not read as what the clean text predicts: the clean text itself prefers the
    contrast (logit(target) − logit(contrast) < 0 on it), or the corruption does not lower the metric
    (m_clean ≤ m_corrupt). The effects are still computed, normalised by m_clean − m_corrupt."""
    name = metric.describe()
    problems = []
    if metric.contrast is not None and m_clean < 0:
        problems.append(
            f"the clean text prefers the contrast ({name} = {m_clean:.4g} on it): the effects measure a "
            "preference the clean text does not have; swap the target and the contrast"
        )
    if m_clean <= m_corrupt:
        problems.append(
            f"the corruption does not lower the metric ({name} = {m_clean:.4g} on the clean text, "
            f"{m_corrupt:.4g} corrupted): the effects say what restores a lower value, not what carries the "
            "target; choose a target the clean text prefers, or swap the texts"
        )
    if problems:
        warn_once("; and ".join(problems), PatchingWarning, about="patch", stacklevel=3)


class _progress_bar:
    """A tqdm bar over sites (a no-op when ``enabled`` is false); called with sites done."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self) -> Any:
        if self.enabled:
            import sys

            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="patching", unit="site", file=sys.stderr)
        return self

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done)

    def __exit__(self, *_exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()
