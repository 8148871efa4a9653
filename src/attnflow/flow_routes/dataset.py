"""Information flow routes over a dataset (`attnflow routes --file` / `--data`), on the run engine
(`attnflow.runs.engine`).

Each text of each source (a *domain*: ``wiki``, ``python-stdlib`` or a file, `read_domains`) is one
work item: its prediction at the last position gets the importance `attnflow.routes` gives it
(`attnflow.flow_routes.api.route_importance`: every head's ``[L, H]`` and every feed-forward
block's, summed over positions, ``[L]``; on the route at τ and with every edge) and its heads'
attention scores (`attnflow.flow_routes.head_roles`). `RouteStep` adds them to `Moments` (count,
sum and sum of squares per domain and quantity: a fixed-size, mergeable state), checkpointed in
``checkpoint.npz`` with the options that decide the numbers. At the end, `summarise` turns them
into means and standard errors over prompts per domain (and over all of them, with several
domains), the top heads with their measured roles, and the heads whose importance differs most
between domains: ``summary.json``, ``report.html`` (`attnflow.viz.routes_data`, connected by the package root) and
``prompts.jsonl`` (the prompts as run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.flow_routes.graph import DEFAULT_THRESHOLD, check_threshold
from attnflow.flow_routes.head_roles import NAMES, SCORES, attention_scores, chance, continues_word, role_of
from attnflow.model_like import ModelLike, model_dtype
from attnflow.runs.checkpoint import RunFolder, digest, versions
from attnflow.runs.engine import EngineOptions, Job, run
from attnflow.runs.readers import NAMED, ReadOptions, open_corpus
from attnflow.staging import atomic_file

CHECKPOINT = "checkpoint.npz"
CHECKPOINT_FORMAT = 1
SUMMARY_JSON = "summary.json"
REPORT = "report.html"
PROMPTS = "prompts.jsonl"
OUTPUTS = (SUMMARY_JSON, REPORT, PROMPTS)
DEFAULT_BATCH = 8  # prompts per batch of the engine (one forward pass each): the checkpoint's step
TOP_HEADS = 12  # heads listed per domain, the most important first
TOP_FFN = 5
TOP_DIFFERENCES = 10
EXAMPLES = 5  # prompts of each domain shown in the report
BY_ROLE = 5  # heads listed per measured role


@dataclass(frozen=True)
class Domain:
    """The texts of one source: ``name`` (what the user gave), ``texts``, ``info`` (the reader's
    description of the source, for summary.json)."""

    name: str
    texts: tuple[str, ...]
    info: dict[str, Any]


def read_domains(
    sources: Sequence[str], *, samples: int | None = None, reading: ReadOptions | None = None, parameter: str = "data"
) -> list[Domain]:
    """One `Domain` per source (``wiki``, ``python-stdlib`` or a .txt/.jsonl/.csv/.parquet file):
    its first ``samples`` texts (all of them for None). A file is read whole first, so that a bad
    line anywhere is one line of error before any work; an empty source is refused."""
    if not sources:
        raise InputError(
            f"{{{parameter}}}: name at least one source (wiki, python-stdlib or a file)", parameter=parameter
        )
    repeated = sorted({source for source in sources if list(sources).count(source) > 1})
    if repeated:
        raise InputError(f"{{{parameter}}}: {', '.join(repeated)} named twice", parameter=parameter)
    domains = []
    for source in sources:
        corpus = open_corpus(source, reading, parameter)
        if corpus.kind not in NAMED:
            corpus.validate()  # the whole file: a bad line is reported before any work
        texts = tuple(islice(corpus, samples))
        if not texts:
            raise InputError(f"{corpus.describe()} has no text", parameter="data" if corpus.kind in NAMED else None)
        info = {key: value for key, value in corpus.info().items() if key != "documents"}
        domains.append(Domain(source, texts, info))
    return domains


def cut(tokenizer: Any, text: str, max_tokens: int | None) -> str:
    """``text`` up to the end of the last whole word among its first ``max_tokens`` tokens (special
    tokens not counted; `attnflow.flow_routes.head_roles.continues_word` says where words end),
    trailing spaces dropped; cut inside the first word when that word alone is longer. The whole
    text when it has at most ``max_tokens`` tokens, or for None."""
    if max_tokens is None:
        return text
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            "{max_tokens} cuts texts at their tokens' character offsets: this model's tokenizer has none",
            parameter="max_tokens",
        )
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    if len(offsets) <= max_tokens:
        return text
    continues = continues_word(text, offsets)
    kept = max_tokens
    while kept > 0 and continues[kept]:  # the first token left out continues a word: leave the word out
        kept -= 1
    end = offsets[(kept or max_tokens) - 1][1]
    return text[:end].rstrip() or text[:end]


@dataclass
class Moments:
    """Per key (``"DOMAIN/QUANTITY"``): how many values were added, their sum and the sum of their
    squares (float64 arrays of one shape per key). Merging adds them; the state is flat arrays
    (``KEY|count``, ``KEY|sum``, ``KEY|squares``) for ``checkpoint.npz`` and Ray. ``predictions``:
    each prompt's (by its index) predicted token id and probability (``INDEX|prediction``)."""

    counts: dict[str, float] = field(default_factory=dict)
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    squares: dict[str, np.ndarray] = field(default_factory=dict)
    predictions: dict[int, tuple[int, float]] = field(default_factory=dict)  # prompt -> (token id, probability)

    def add(self, key: str, value: Any, count: float = 1.0, squares: Any = None) -> None:
        """Add one value (or, with ``squares``, a sum of ``count`` values and of their squares)."""
        value = np.asarray(value, dtype=np.float64)
        squared = value * value if squares is None else np.asarray(squares, dtype=np.float64)
        if key in self.sums:
            self.counts[key] += count
            self.sums[key] = self.sums[key] + value
            self.squares[key] = self.squares[key] + squared
        else:
            self.counts[key], self.sums[key], self.squares[key] = float(count), value.copy(), squared.copy()

    def merge(self, other: "Moments") -> "Moments":
        for key in other.sums:
            self.add(key, other.sums[key], other.counts[key], other.squares[key])
        self.predictions.update(other.predictions)
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {}
        for key in self.sums:
            state |= {f"{key}|count": np.float64(self.counts[key]), f"{key}|sum": self.sums[key]}
            state[f"{key}|squares"] = self.squares[key]
        for index, (token, probability) in self.predictions.items():
            state[f"{index}|prediction"] = np.array([token, probability], dtype=np.float64)
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Moments":
        found = cls()
        for name, value in state.items():
            key, _, part = name.rpartition("|")
            if part == "count":
                found.counts[key] = float(value)
            elif part == "prediction":
                found.predictions[int(key)] = (int(value[0]), float(value[1]))
            else:
                {"sum": found.sums, "squares": found.squares}[part][key] = np.array(value, dtype=np.float64)
        return found

    def pooled(self, domains: Sequence[int]) -> "Moments":
        """The moments of ``domains`` (their indices) added together, keyed by quantity alone."""
        found = Moments()
        for key in self.sums:
            domain, _, quantity = key.partition("/")
            if int(domain) in domains:
                found.add(quantity, self.sums[key], self.counts[key], self.squares[key])
        return found

    def statistic(self, key: str) -> dict[str, Any] | None:
        """``{"mean", "se", "count"}`` of ``key`` (the standard error of the mean over the values
        added: NaN with one value); None when nothing was added."""
        if key not in self.sums:
            return None
        count, total, squares = self.counts[key], self.sums[key], self.squares[key]
        mean = total / count
        variance = (
            np.maximum(squares - count * mean * mean, 0.0) / (count - 1) if count > 1 else np.full_like(mean, np.nan)
        )
        return {"mean": mean, "se": np.sqrt(variance / count), "count": int(count)}


@dataclass(frozen=True)
class PromptBatch:
    """Consecutive prompts: ``items`` of ``(index, domain, text)``."""

    items: tuple[tuple[int, int, str], ...]

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class RouteStep:
    """`attnflow.runs.engine.Step` of routes over a dataset: a model replica; per prompt its
    components' importance and its heads' attention scores added to `Moments` (`add_prompt`)."""

    model: str
    threshold: float
    norm: int
    dtype: str = "float32"

    def load(self, device: str) -> ModelLike:
        from attnflow.model import load

        return load(self.model, device=device, dtype=self.dtype)

    def empty(self, model: ModelLike) -> Moments:  # noqa: ARG002 - the Step protocol
        return Moments()

    def run(self, model: ModelLike, moments: Moments, batch: PromptBatch) -> Moments:
        for index, domain, text in batch.items:
            add_prompt(moments, domain, model, text, self.threshold, self.norm, index)
        return moments


def add_prompt(
    moments: Moments, domain: int, model: ModelLike, text: str, threshold: float, norm: int, index: int | None = None
) -> None:
    """One prompt's numbers into ``moments`` under ``domain``: ``heads`` / ``heads_full`` (each
    head's importance on the route and with every edge, `attnflow.routes`' ``importance.heads``),
    ``ffn`` / ``ffn_full`` (each feed-forward block's, summed over positions), ``tokens``, each
    attention score of `attnflow.flow_routes.head_roles` it measures and its chance level; and,
    under the prompt's ``index``, the model's prediction (a model with a language-model head)."""
    from attnflow.flow_routes.api import route_importance

    found = route_importance(model, text, threshold, norm=norm)
    if index is not None and found.prediction is not None:
        moments.predictions[index] = (int(found.prediction["id"]), float(found.prediction["probability"]))
    continues = _continues(model.tokenizer, text, len(found.tokens))
    quantities = {
        "heads": found.importance.heads,
        "heads_full": found.importance_full.heads,
        "ffn": found.importance.ffn.sum(axis=1),
        "ffn_full": found.importance_full.ffn.sum(axis=1),
        "tokens": float(len(found.tokens)),
        **attention_scores(found.attentions, continues),
        **{f"chance.{name}": value for name, value in chance(found.attentions, continues).items()},
    }
    for name, value in quantities.items():
        if value is not None:
            moments.add(f"{domain}/{name}", value)


def _continues(tokenizer: Any, text: str, n_tokens: int) -> np.ndarray:
    """`continues_word` of the model's own tokens of ``text`` (special tokens included, as the
    route reads them); none for a tokenizer without character offsets."""
    if not getattr(tokenizer, "is_fast", False):
        return np.zeros(n_tokens, dtype=bool)
    offsets = tokenizer(text, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    return continues_word(text, offsets) if len(offsets) == n_tokens else np.zeros(n_tokens, dtype=bool)


def before_last_word(text: str) -> str:
    """``text`` without its last word (the last run of characters without white space, trailing
    white space dropped first) and the white space before it: "Paris is the capital of France."
    -> "Paris is the capital of", whose next token is the first of " France.". The whole text when
    it is one word."""
    stripped = text.rstrip()
    start = len(stripped)
    while start > 0 and not stripped[start - 1].isspace():
        start -= 1
    return stripped[:start].rstrip() or text


def prepare(
    model: ModelLike, domains: list[Domain], max_tokens: int | None, last_word: bool = False
) -> list[tuple[int, int, str]]:
    """``(index, domain, prompt)`` of every text, cut to ``max_tokens`` (`cut`); with ``last_word``,
    a text that cut leaves whole is cut before its last word (`before_last_word`). A prompt longer
    than the model reads is refused in one line (no truncation without ``max_tokens``)."""
    prompts: list[tuple[int, int, str]] = []
    for number, domain in enumerate(domains):
        for position, text in enumerate(domain.texts):
            prompt = cut(model.tokenizer, text, max_tokens)
            if last_word and prompt == text:
                prompt = before_last_word(text)
            length = len(model.tokenizer(prompt, verbose=False)["input_ids"])
            if length > model.max_length:
                raise InputError(
                    f"{domain.name}: text {position + 1} is {length} tokens, more than {model.name} reads "
                    f"({model.max_length}); cut the texts with {{max_tokens}}",
                    parameter="max_tokens",
                )
            prompts.append((len(prompts), number, prompt))
    return prompts


def _check_counts(samples: Any, max_tokens: Any, batch_size: Any, norm: Any) -> None:
    for name, value in (("samples", samples), ("max_tokens", max_tokens), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{{{name}}} must be a positive integer, not {value!r}", parameter=name)
    if norm not in (1, 2):
        raise InputError(f"{{norm}} must be 1 or 2, not {norm!r}", parameter="norm")


def _check_outside(domains: list[Domain], out: Path, owned: Callable[[str], bool], parameter: str) -> None:
    """A source file must not be one of the files the run writes in ``out``."""
    for domain in domains:
        path = Path(domain.name)
        if domain.name in NAMED or path.resolve().parent != out.resolve():
            continue
        if owned(path.name) or path.name == CHECKPOINT:
            raise InputError(
                f"{{{parameter}}} {domain.name} is named like a file this run writes in {{out}} {out}: "
                "rename it or choose another {out}",
                parameter=[parameter, "out"],
            )


def routes_over_data(
    model: ModelLike | str,
    sources: Sequence[str],
    out: str | Path,
    *,
    samples: int | None = None,
    max_tokens: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    norm: int = 1,
    batch_size: int = DEFAULT_BATCH,
    reading: ReadOptions | None = None,
    parameter: str = "data",
    resume: bool = False,
    overwrite: bool = False,
    engine: EngineOptions | None = None,
    owned: Callable[[str], bool] = OUTPUTS.__contains__,
    dtype: str = "float32",
    last_word: bool = False,
) -> dict[str, Any]:
    """The routes of every text of ``sources`` (each a domain: `read_domains`, its first
    ``samples`` texts, each cut to ``max_tokens``: `cut`) added up into folder ``out``; returns
    the summary (also written there: `summarise`). ``threshold`` and ``norm``: as in
    `attnflow.routes`. ``model``: a loaded model, or a name (Ray's actors load their own replicas
    by name). ``out`` holding an earlier run: ``resume`` continues it (under the same options: a
    changed one is refused, named), ``overwrite`` starts again. ``parameter``: the parameter the
    messages name for the sources (``file`` or ``data``). ``dtype``: the precision a model named by
    ``model`` loads in (`attnflow.load`; a loaded model keeps its own). ``last_word``: the texts are
    documents, not prompts: each one ``max_tokens`` leaves whole is cut before its last word
    (`before_last_word`), so that the prediction explained is that word's first token rather than
    whatever follows the text's final period. Each prompt's prediction and its probability (a model
    with a language-model head) go into ``prompts.jsonl`` and the report's examples."""
    threshold = check_threshold(threshold)
    _check_counts(samples, max_tokens, batch_size, norm)
    engine = engine or EngineOptions()
    engine.check()
    domains = read_domains(sources, samples=samples, reading=reading, parameter=parameter)
    out = Path(out)
    _check_outside(domains, out, owned, parameter)
    name = model if isinstance(model, str) else model.name
    precision = dtype if isinstance(model, str) else model_dtype(model)
    fields = {
        "model": name,
        "dtype": precision,
        "data": [{"source": domain.name, "texts": digest(list(domain.texts))} for domain in domains],
        **{"samples": samples, "max_tokens": max_tokens, "threshold": threshold, "norm": norm},
        **({"last_word": True} if last_word else {}),  # absent when False: earlier checkpoints still resume
    }
    with RunFolder(
        out, kind="routes", checkpoint=CHECKPOINT, owned=owned, state_format=CHECKPOINT_FORMAT,
        resume=resume, overwrite=overwrite, fields=fields,
    ) as folder:  # fmt: skip
        if isinstance(model, str):
            from attnflow.model import load

            model = load(model, device=engine.driver_device, progress=not engine.quiet, dtype=dtype)
        from attnflow.flow_routes.forward import check_supported

        check_supported(model)
        prompts = prepare(model, domains, max_tokens, last_word)
        job = Job(
            name="routes",
            unit="prompt",
            total=len(prompts),
            fields=fields,
            step=RouteStep(name, threshold, norm, precision),
            result=Moments(),
            batches=lambda start: (
                PromptBatch(tuple(prompts[first : first + batch_size]))
                for first in range(start, len(prompts), batch_size)
            ),
            label=lambda batch: domains[batch.items[0][1]].name,
        )
        finished = run(job, folder, engine, context=model)
        predictions = described_predictions(finished.result, model)
        summary = summarise(finished.result, domains, prompts, model, fields, predictions)
        summary["seconds"] = finished.elapsed_s
        summary["seconds_per_prompt"] = finished.elapsed_s / max(1, finished.done)
        write_outputs(folder.out, summary, prompts, domains, predictions)
    return summary


HEAD_QUANTITIES = {"importance": "heads", "importance_full": "heads_full", **{name: name for name in SCORES}}
FFN_QUANTITIES = {"importance": "ffn", "importance_full": "ffn_full"}
ROLE_SCORES = {name: score for score, name in NAMES.items()}  # a role's name -> the share that names it


def described_predictions(moments: Moments, model: ModelLike) -> dict[int, dict[str, Any]]:
    """Each prompt's prediction (by its index): ``{"prediction": token, "prediction_id",
    "probability"}``."""
    return {
        index: {"prediction": model.tokenizer.decode([token]), "prediction_id": token, "probability": probability}
        for index, (token, probability) in sorted(moments.predictions.items())
    }


def summarise(
    moments: Moments,
    domains: list[Domain],
    prompts: list[tuple[int, int, str]],
    model: ModelLike,
    fields: dict,
    predictions: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The summary: per domain (`domain_summary`; with several domains also ``all`` of them
    pooled) the mean and standard error over prompts of each head's and each feed-forward block's
    importance and of each head's attention scores, the top heads with their roles, and the heads
    whose importance differs most between each domain and the first (``differences``); the first
    prompts of each domain with their ``predictions`` (`described_predictions`, None where there is none)."""
    predictions = predictions or {}
    summary: dict[str, Any] = {
        "model": model.name,
        "n_layers": model.n_layers,
        "n_heads": int(model.n_heads),
        **{key: fields[key] for key in ("samples", "max_tokens", "threshold", "norm")},
        "last_word": bool(fields.get("last_word", False)),
        "prompts": len(prompts),
        "domains": [
            {
                **domain_summary(moments.pooled([number]), domain.name, domain.info, _examples(prompts, number)),
                "predictions": [predictions.get(index) for index in _example_indices(prompts, number)],
            }
            for number, domain in enumerate(domains)
        ],
        "versions": versions(),
    }
    if len(domains) > 1:
        summary["all"] = domain_summary(moments.pooled(range(len(domains))), "all", {}, [])
        summary["differences"] = [_differences(summary["domains"][0], other) for other in summary["domains"][1:]]
    return summary


def _examples(prompts: list[tuple[int, int, str]], domain: int) -> list[str]:
    return [text for _, number, text in prompts if number == domain][:EXAMPLES]


def _example_indices(prompts: list[tuple[int, int, str]], domain: int) -> list[int]:
    return [index for index, number, _ in prompts if number == domain][:EXAMPLES]


def domain_summary(moments: Moments, name: str, info: dict[str, Any], examples: list[str]) -> dict[str, Any]:
    """One domain's numbers (`summarise`): ``heads`` and ``ffn`` (each quantity's ``mean``, ``se``
    and ``count``), ``chance`` (each attention score under evenly spread attention), the mean
    ``tokens`` per prompt, ``top_heads`` (with their measured ``role``), ``top_ffn`` and
    ``by_role`` (`_by_role`)."""
    heads = {name: moments.statistic(key) for name, key in HEAD_QUANTITIES.items()}
    ffn = {name: moments.statistic(key) for name, key in FFN_QUANTITIES.items()}
    chances = {score: moments.statistic(f"chance.{score}") for score in SCORES}
    tokens = moments.statistic("tokens")
    found = {
        "name": name,
        "source": info,
        "prompts": 0 if tokens is None else tokens["count"],
        "tokens": None if tokens is None else float(tokens["mean"]),
        "examples": examples,
        "chance": {score: None if value is None else float(value["mean"]) for score, value in chances.items()},
        "top_heads": _top_heads(heads),
        "top_ffn": _top_ffn(ffn),
        "by_role": _by_role(heads),
        "heads": {key: _plain(value) for key, value in heads.items()},
        "ffn": {key: _plain(value) for key, value in ffn.items()},
    }
    return found


def _top_heads(heads: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    importance = heads["importance"]
    if importance is None:
        return []
    listed = []
    for flat in np.argsort(-importance["mean"], axis=None, kind="stable")[:TOP_HEADS]:
        layer, head = (int(n) for n in np.unravel_index(flat, importance["mean"].shape))
        entry: dict[str, Any] = {"layer": layer, "head": head}
        for quantity, value in heads.items():
            entry[quantity] = None if value is None else _number(value["mean"][layer, head])
            entry[f"{quantity}_se"] = None if value is None else _number(value["se"][layer, head])
        entry["role"] = role_of({score: entry[score] for score in SCORES})
        listed.append(entry)
    return listed


def _by_role(heads: dict[str, dict[str, Any] | None]) -> dict[str, list[dict[str, Any]]]:
    """Every head named by a role (`attnflow.flow_routes.head_roles.role_of`; not the mixed ones):
    per role, the `BY_ROLE` heads with the largest share of that kind, each with its ``score``,
    ``importance`` and importance ``rank`` among all heads (1: the most important)."""
    importance = heads["importance"]
    if importance is None:
        return {}
    means = {score: None if (value := heads[score]) is None else value["mean"] for score in SCORES}
    order = np.argsort(-importance["mean"], axis=None, kind="stable")
    rank = np.empty(order.size, dtype=int)
    rank[order] = np.arange(1, order.size + 1)
    found: dict[str, list[dict[str, Any]]] = {}
    for flat in range(order.size):
        layer, head = (int(n) for n in np.unravel_index(flat, importance["mean"].shape))
        scores = {score: None if value is None else _number(value[layer, head]) for score, value in means.items()}
        role = role_of(scores)
        if role not in ROLE_SCORES:
            continue
        found.setdefault(role, []).append(
            {"layer": layer, "head": head, "score": scores[ROLE_SCORES[role]]}
            | {"importance": _number(importance["mean"][layer, head]), "rank": int(rank[flat])}
        )
    return {role: sorted(listed, key=lambda entry: -entry["score"])[:BY_ROLE] for role, listed in found.items()}


def _top_ffn(ffn: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    importance = ffn["importance"]
    if importance is None:
        return []
    order = np.argsort(-importance["mean"], kind="stable")[:TOP_FFN]
    return [
        {"layer": int(layer)}
        | {
            key: None if value is None else _number(value[stat][layer])
            for quantity, value in ffn.items()
            for stat, key in (("mean", quantity), ("se", f"{quantity}_se"))
        }
        for layer in order
    ]


def _differences(first: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The heads whose mean importance differs most (in absolute value) between ``other`` and
    ``first``: the difference, its standard error √(se₁² + se₂²) and their ratio z."""
    a, b = (np.asarray(floats(domain["heads"]["importance"]["mean"])) for domain in (first, other))
    se_a, se_b = (np.asarray(floats(domain["heads"]["importance"]["se"])) for domain in (first, other))
    difference, se = b - a, np.sqrt(se_a**2 + se_b**2)
    listed = []
    for flat in np.argsort(-np.abs(difference), axis=None, kind="stable")[:TOP_DIFFERENCES]:
        layer, head = (int(n) for n in np.unravel_index(flat, difference.shape))
        z = difference[layer, head] / se[layer, head] if se[layer, head] > 0 else np.nan
        listed.append(
            {
                "layer": layer,
                "head": head,
                first["name"]: _number(a[layer, head]),
                other["name"]: _number(b[layer, head]),
            }
            | {"difference": _number(difference[layer, head]), "se": _number(se[layer, head]), "z": _number(z)}
        )
    return {"domain": other["name"], "against": first["name"], "heads": listed}


def _number(value: Any) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


def _plain(statistic: dict[str, Any] | None) -> dict[str, Any] | None:
    """A `Moments.statistic` as JSON: arrays as (nested) lists, NaN as null."""
    if statistic is None:
        return None
    return {
        "mean": _listed(statistic["mean"]),
        "se": _listed(statistic["se"]),
        "count": statistic["count"],
    }


def _listed(array: np.ndarray) -> Any:
    return _nulls(np.asarray(array).tolist())


def _nulls(value: Any) -> Any:
    if isinstance(value, list):
        return [_nulls(item) for item in value]
    return value if value is None or np.isfinite(value) else None


def floats(value: Any) -> Any:
    """A summary's numbers with its nulls (NaN written to JSON) as NaN again."""
    if isinstance(value, list):
        return [floats(item) for item in value]
    return np.nan if value is None else value


def write_outputs(
    out: Path,
    summary: dict[str, Any],
    prompts: list[tuple[int, int, str]],
    domains: list[Domain],
    predictions: dict[int, dict[str, Any]] | None = None,
) -> None:
    """``summary.json``, ``report.html`` and ``prompts.jsonl`` (each prompt as run: its index,
    domain and text, and its ``predictions`` entry: the predicted token, its id and probability),
    each atomically."""
    from attnflow.flow_routes.result import _VIEWS

    predictions = predictions or {}
    with atomic_file(out / PROMPTS) as handle:
        rows = (
            {"index": index, "domain": domains[number].name, "text": text, **predictions.get(index, {})}
            for index, number, text in prompts
        )
        handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
    with atomic_file(out / SUMMARY_JSON) as handle:
        handle.write(json.dumps(summary, indent=1, allow_nan=False).encode("utf-8"))
    with atomic_file(out / REPORT) as handle:
        handle.write(_VIEWS["data_html"](summary).encode("utf-8"))
