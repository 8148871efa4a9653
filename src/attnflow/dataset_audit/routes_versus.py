"""``attnflow routes --data … --versus MODEL``: what changed between two language models over the
same prompts, on the run engine, in the report form of ``attnflow audit --versus``
(`attnflow.dataset_audit.versus`: its word table, intervals, lead and page).

Each prompt (read and cut as `attnflow.flow_routes.dataset.routes_over_data` does, with the first
model's tokenizer) is read by both models:

- **words** (any two models: tokenizers may differ): each model explains its own next-token
  prediction with ``method`` (default ``attnlrp``); per prompt and word, the word's share of the
  prompt's absolute relevance (`attnflow.dataset_audit.words.word_relevance`), paired per prompt
  (`attnflow.dataset_audit.versus.add_sides`);
- **heads** (comparable heads: the same tokens, layers and heads, as a fine-tune and its base):
  each head's importance for the prediction on the route and with every edge and its attention
  scores (`attnflow.flow_routes.head_roles`), paired per prompt (`Moments` under ``0/`` the model,
  ``1/`` ``--versus``, ``2/`` their difference), and each feed-forward block's importance per layer;
- **predictions**: prompts whose predicted next token differs (by its text).

Everything merges by addition, so local, Ray and resumed runs end with the same numbers.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnflow.dataset_audit.versus import WORD_SUMS, add_words, word_changes
from attnflow.errors import ExplanationWarning, InputError, ModelLoadError
from attnflow.flow_routes.dataset import (
    DEFAULT_BATCH,
    Moments,
    PromptBatch,
    _check_counts,
    _continues,
    prepare,
    read_domains,
)
from attnflow.flow_routes.graph import DEFAULT_THRESHOLD, check_threshold
from attnflow.flow_routes.head_roles import SCORES, attention_scores
from attnflow.model_like import ModelLike, model_dtype
from attnflow.runs.checkpoint import RunFolder, digest, versions
from attnflow.runs.engine import EngineOptions, Job, run
from attnflow.runs.readers import ReadOptions
from attnflow.staging import atomic_file
from attnflow.statistics import Z95

CHECKPOINT = "checkpoint.json"
CHECKPOINT_FORMAT = 1
RESULTS = "results.json"
REPORT = "report.html"
OUTPUTS = (RESULTS, REPORT)
DEFAULT_METHOD = "attnlrp"
HEAD_QUANTITIES = ("heads", "heads_full", *SCORES)  # per [layer, head], paired per prompt
MIN_COUNT = 3
TOP = 20


@dataclass
class RoutesVersus:
    """The accumulator: ``moments`` (``0/``, ``1/``, ``2/`` + quantity: the model, ``--versus``,
    their difference per prompt), ``words`` (word -> `attnflow.dataset_audit.versus.WORD_SUMS`),
    ``prompts`` read and ``changed`` (prompts whose predicted next token differs)."""

    moments: Moments = field(default_factory=Moments)
    words: dict[str, list[float]] = field(default_factory=dict)
    prompts: int = 0
    changed: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first changed predictions, by index

    def merge(self, other: "RoutesVersus") -> "RoutesVersus":
        self.moments.merge(other.moments)
        for word, sums in other.words.items():
            mine = self.words.setdefault(word, [0.0] * WORD_SUMS)
            for column, value in enumerate(sums):
                mine[column] += value
        self.prompts += other.prompts
        self.changed += other.changed
        self.examples = sorted(self.examples + other.examples, key=lambda entry: entry["index"])[:TOP]
        return self

    def state_dict(self) -> dict[str, Any]:
        arrays = {key: np.asarray(value).tolist() for key, value in self.moments.state_dict().items()}
        return {"moments": arrays, "words": self.words, "prompts": self.prompts, "changed": self.changed,
                "examples": self.examples}  # fmt: skip

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "RoutesVersus":
        moments = Moments.from_state_dict({key: np.asarray(value) for key, value in state["moments"].items()})
        return cls(moments, state["words"], state["prompts"], state["changed"], state["examples"])


def comparable_heads(model: ModelLike, versus: ModelLike) -> bool:
    """Heads compare one to one when both models read the same tokens with the same layers and
    heads (a fine-tune and its base); otherwise only words compare."""
    if (model.n_layers, model.n_heads) != (versus.n_layers, versus.n_heads):
        return False
    return bool(model.tokenizer.get_vocab() == versus.tokenizer.get_vocab())


@dataclass(frozen=True)
class RoutesVersusStep:
    """The `attnflow.runs.engine.Step`: both models per worker; each prompt into a `RoutesVersus`
    (`add_pair`)."""

    model: str
    versus: str
    method: str
    threshold: float
    norm: int
    heads: bool
    dtype: str = "float32"

    def load(self, device: str) -> tuple[ModelLike, ModelLike]:
        from attnflow.model import load

        return load(self.model, device=device, dtype=self.dtype), load(self.versus, device=device, dtype=self.dtype)

    def empty(self, context: Any) -> RoutesVersus:  # noqa: ARG002 - the Step protocol
        return RoutesVersus()

    def run(self, context: tuple[ModelLike, ModelLike], result: RoutesVersus, batch: PromptBatch) -> RoutesVersus:
        for index, _, text in batch.items:
            add_pair(result, context, text, index, self)
        return result


def add_pair(
    result: RoutesVersus, models: tuple[ModelLike, ModelLike], text: str, index: int, step: RoutesVersusStep
) -> None:
    """One prompt read by both models into ``result`` (see the module doc)."""
    words, predicted, explanations = [], [], []
    with warnings.catch_warnings():  # a map's notes are kept by `attnflow explain`, not counted here
        warnings.simplefilter("ignore", ExplanationWarning)
        for model in models:
            explanations.append(model.explain(text, step.method))
    from attnflow.dataset_audit.words import word_relevance

    for explanation in explanations:
        words.append(word_relevance(text, explanation.offsets, explanation.special_mask, explanation.scores))
        predicted.append(str(explanation.prediction["label"]))
    add_words(result.words, words[0], words[1])
    result.prompts += 1
    if predicted[0].strip() != predicted[1].strip():
        result.changed += 1
        if len(result.examples) < TOP:
            result.examples.append({"index": index, "text": text, "model": predicted[0], "versus": predicted[1]})
    if step.heads:
        _add_heads(result.moments, models, text, step.threshold, step.norm)


def _add_heads(moments: Moments, models: tuple[ModelLike, ModelLike], text: str, threshold: float, norm: int) -> None:
    from attnflow.flow_routes.api import route_importance

    sides = []
    for model in models:
        found = route_importance(model, text, threshold, norm=norm)
        scores = attention_scores(found.attentions, _continues(model.tokenizer, text, len(found.tokens)))
        sides.append(
            {"heads": found.importance.heads, "heads_full": found.importance_full.heads,
             "ffn": found.importance.ffn.sum(axis=1), **scores}
        )  # fmt: skip
    for name in sides[0]:
        a, b = sides[0][name], sides[1].get(name)
        if a is None or b is None:
            continue
        for side, value in enumerate((a, b, np.asarray(a) - np.asarray(b))):
            moments.add(f"{side}/{name}", value)


def routes_versus(
    model: ModelLike | str,
    versus: ModelLike | str,
    sources: Sequence[str],
    out: str | Path,
    *,
    method: str = DEFAULT_METHOD,
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
    dtype: str = "float32",
    last_word: bool = False,
    min_count: int = MIN_COUNT,
) -> dict[str, Any]:
    """Two language models over the prompts of ``sources`` (read and cut as
    `attnflow.flow_routes.dataset.routes_over_data` does) into folder ``out``: ``results.json``
    and ``report.html`` (`attnflow.dataset_audit.report.build_report`); returns the results.
    ``model`` / ``versus``: loaded models or names; ``method``: the relevance method of the words.

    Raises:
        InputError: bad options or data, a ``versus`` that cannot load, a prompt too long for either.
    """
    from attnflow.methods.registry import get_method

    threshold = check_threshold(threshold)
    _check_counts(samples, max_tokens, batch_size, norm)
    get_method(method)
    engine = engine or EngineOptions()
    engine.check()
    domains = read_domains(sources, samples=samples, reading=reading, parameter=parameter)
    names = [item if isinstance(item, str) else item.name for item in (model, versus)]
    precision = dtype if isinstance(model, str) else model_dtype(model)
    fields = {
        "model": names[0], "versus": names[1], "method": method, "dtype": precision,
        "data": [{"source": domain.name, "texts": digest(list(domain.texts))} for domain in domains],
        "samples": samples, "max_tokens": max_tokens, "threshold": threshold, "norm": norm, "last_word": last_word,
    }  # fmt: skip
    with RunFolder(
        out, kind="routes --versus", checkpoint=CHECKPOINT, owned=OUTPUTS.__contains__,
        state_format=CHECKPOINT_FORMAT, resume=resume, overwrite=overwrite, fields=fields,
    ) as folder:  # fmt: skip
        first, second = _loaded(model, versus, engine, dtype)
        prompts = prepare(first, domains, max_tokens, last_word)
        _check_lengths(second, prompts)
        heads = comparable_heads(first, second)
        job = Job(
            name=f"routes --versus ({method})",
            unit="prompt",
            total=len(prompts),
            fields=fields,
            step=RoutesVersusStep(names[0], names[1], method, threshold, norm, heads, precision),
            result=RoutesVersus(),
            batches=lambda start: (
                PromptBatch(tuple(prompts[at : at + batch_size])) for at in range(start, len(prompts), batch_size)
            ),
        )
        finished = run(job, folder, engine, context=(first, second))
        results = summarise(finished.result, first, second, fields, heads, min_count)
        results["run"].update(elapsed_s=round(finished.elapsed_s, 3), engine=engine.engine,
                              data=", ".join(domain.name for domain in domains))  # fmt: skip
        write_outputs(folder.out, results)
    return results


def _loaded(
    model: ModelLike | str, versus: ModelLike | str, engine: EngineOptions, dtype: str
) -> tuple[ModelLike, ModelLike]:
    from attnflow.flow_routes.forward import check_supported
    from attnflow.model import load

    found = []
    for item, parameter in ((model, "model"), (versus, "versus")):
        if isinstance(item, str):
            try:
                item = load(item, device=engine.driver_device, progress=not engine.quiet, dtype=dtype)
            except ModelLoadError as error:
                if parameter == "model":
                    raise
                raise InputError(f"{{versus}} {versus}: {error}", parameter="versus") from None
        found.append(item)
    for item in found:
        check_supported(item)
        if item.is_classifier:
            raise InputError(f"{item.name} is a classifier: routes' {{versus}} compares language models' next "
                             "tokens (two classifiers: the audit's {versus})", parameter="versus")  # fmt: skip
    return found[0], found[1]


def _check_lengths(model: ModelLike, prompts: list[tuple[int, int, str]]) -> None:
    for index, _, text in prompts:
        length = len(model.tokenizer(text, verbose=False)["input_ids"])
        if length > model.max_length:
            raise InputError(
                f"prompt {index + 1} is {length} tokens, more than {{versus}} {model.name} reads "
                f"({model.max_length}); cut the texts with {{max_tokens}}",
                parameter=("versus", "max_tokens"),
            )


def summarise(
    result: RoutesVersus, model: ModelLike, versus: ModelLike, fields: dict, heads: bool, min_count: int
) -> dict[str, Any]:
    """results.json in the form of a two-model audit (`attnflow.dataset_audit.versus`): ``run``
    and ``changes`` (words, predictions, and with comparable heads ``heads`` and ``ffn``)."""
    from attnflow.dataset_audit.analysis import wilson_interval
    from attnflow.dataset_audit.versus import lead

    n = result.prompts
    rate, low, high = wilson_interval(result.changed, n)
    run_info = {
        "model": model.name, "versus": versus.name, "sides": [model.name, versus.name], "method": fields["method"],
        "samples": n, "min_count": min_count, "labels": [], "split": "prompts as run", "head_statistics": heads,
        **{key: fields[key] for key in ("max_tokens", "threshold", "norm")}, "versions": versions(),
    }  # fmt: skip
    changes: dict[str, Any] = {
        "paired": True,
        "texts": [n, n],
        "words": word_changes(result.words, (n, n), min_count, TOP),
        "words_per_group": [],
        "predictions": {
            "texts": n,
            "changed": result.changed,
            "changed_rate": rate,
            "changed_rate_ci": [low, high],
            "next_tokens": result.examples,
            "examples": [],
        },
    }
    if heads:
        changes["heads"] = head_changes(result.moments, int(model.n_layers), int(model.n_heads))
        changes["ffn"] = _ffn(result.moments)
    results = {"run": run_info, "changes": changes}
    changes["lead"] = lead(results)
    return results


def head_changes(moments: Moments, layers: int, heads: int) -> dict[str, Any]:
    """Per quantity of `HEAD_QUANTITIES`: each head's mean on both sides and the mean paired change
    with its normal 95 % interval (mean ± Z95 · se), the heads that moved most (``moved``) and the per-layer means."""
    found: dict[str, Any] = {"layers": layers, "heads": heads}
    for name in HEAD_QUANTITIES:
        a, b, d = (moments.statistic(f"{side}/{name}") for side in range(3))
        if a is None or b is None or d is None:
            continue
        rows = [
            {"layer": layer, "head": head, "model": float(a["mean"][layer, head]),
             "versus": float(b["mean"][layer, head]), **_change(d, (layer, head))}
            for layer in range(layers) for head in range(heads)
        ]  # fmt: skip
        found[name] = {
            "per_layer": [
                {"layer": layer, "model": float(a["mean"][layer].mean()), "versus": float(b["mean"][layer].mean())}
                for layer in range(layers)
            ],
            "moved": sorted(rows, key=lambda row: (-abs(row["change"]), row["layer"], row["head"]))[:TOP],
        }
    return found


def _change(statistic: dict[str, Any], at: Any) -> dict[str, Any]:
    mean, se = float(statistic["mean"][at]), float(statistic["se"][at])
    ci = [mean - Z95 * se, mean + Z95 * se] if math.isfinite(se) else [None, None]
    return {"change": mean, "ci": ci}


def _ffn(moments: Moments) -> list[dict[str, Any]]:
    a, b, d = (moments.statistic(f"{side}/ffn") for side in range(3))
    if a is None or b is None or d is None:
        return []
    return [
        {"layer": layer, "model": float(a["mean"][layer]), "versus": float(b["mean"][layer]), **_change(d, layer)}
        for layer in range(len(a["mean"]))
    ]


def write_outputs(out: Path, results: dict[str, Any]) -> None:
    """results.json and report.html, each atomically."""
    from attnflow.dataset_audit.engine import finite
    from attnflow.dataset_audit.report import build_report

    with atomic_file(out / RESULTS) as handle:
        handle.write((json.dumps(finite(results), indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
    with atomic_file(out / REPORT) as handle:
        handle.write(build_report(results).encode("utf-8"))
