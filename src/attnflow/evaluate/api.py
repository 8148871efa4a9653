"""`evaluate`: model + task + methods -> results, written to a folder (what the CLI calls)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnflow.datasets import DEFAULT_WINDOW, NEXT_TOKEN_PROBES, NEXT_TOKEN_TASK
from attnflow.errors import InputError
from attnflow.evaluate.benchmark import (
    BOUNDS_FILE,
    CHECKPOINT,
    CHECKPOINT_FORMAT,
    METHODS_DIR,
    RUN_FILE,
    BenchmarkOptions,
    run_benchmark,
)
from attnflow.evaluate.report import BARS_PNG, CURVES_PNG, RESULTS_HTML, RESULTS_MD
from attnflow.evaluate.scorer import check_classifier
from attnflow.model_like import ModelLike, model_dtype
from attnflow.runs.checkpoint import RunFolder
from attnflow.runs.engine import EngineOptions
from attnflow.staging import atomic_file

log = logging.getLogger(__name__)

RESULTS_JSON = "results.json"
OUTPUT_NAMES = (RESULTS_JSON, RUN_FILE, BOUNDS_FILE, METHODS_DIR, RESULTS_MD, RESULTS_HTML, CURVES_PNG, BARS_PNG)


def is_evaluate_output(name: str) -> bool:
    """Whether a folder entry is something `evaluate` writes."""
    return name in OUTPUT_NAMES


DEFAULT_SAMPLES = 500  # evaluate's examples when --samples is not given (fewer when the data has fewer)


def select_samples(n_available: int, samples: int | None, seed: int) -> np.ndarray:
    """``min(samples, n_available)`` distinct indices drawn with ``default_rng(seed)``, sorted; a
    request above ``n_available`` is capped with a warning. ``samples=None`` (not given): up to
    `DEFAULT_SAMPLES`, capped without a warning."""
    if samples is None:
        samples = min(DEFAULT_SAMPLES, n_available)
    if samples < 1:
        raise InputError(f"{{samples}} must be at least 1, got {samples}", parameter="samples")
    if samples > n_available:
        log.warning(
            "--samples %d is more than the %d held-out examples; using all %d", samples, n_available, n_available
        )
        samples = n_available
    return np.sort(np.random.default_rng(seed).choice(n_available, size=samples, replace=False))


NEXT_TOKEN_TASKS = (NEXT_TOKEN_TASK, NEXT_TOKEN_PROBES)  # the tasks of causal language models
DEFAULT_METHODS = "default"  # auto's candidates, rollout and random (leave-one-out: the agreement reference)
BASELINES = ("rollout", "random")  # the attention baseline and chance


def resolve_methods(methods: str | Sequence[str], family: Any = None, target_kind: str | None = None) -> list[str]:
    """``"all"``, ``"default"`` or names (a comma-separated string or a list) -> registered method
    names. ``"all"``: every method that ``family`` (a model's adapter row) supports (every
    registered one for None); ``"default"``: ``--method auto``'s candidates for that family and
    ``target_kind`` (`attnflow.evaluate.per_input.auto_methods`) and the `BASELINES` it supports —
    whether auto chooses well, against attention rollout and chance (leave-one-out, the agreement
    reference, is explained either way; its own metrics row costs a run's perturbations again, so
    it is a name to add)."""
    from attnflow.evaluate.per_input import auto_methods
    from attnflow.methods.registry import available_methods, method_names, methods_for

    name = methods.strip() if isinstance(methods, str) else None
    if name in ("all", DEFAULT_METHODS):
        every = available_methods() if family is None else methods_for(family)
        if name == "all":
            return every
        return [m for m in auto_methods(family, target_kind) if m in every] + [m for m in BASELINES if m in every]
    if not methods:
        raise ValueError("no methods given")
    return method_names(methods)


def check_task_name(task: str | None) -> None:
    """InputError, before any model loads, for a name that is neither a built-in task nor an
    existing file (None: the default task)."""
    from attnflow.datasets import TASKS

    if task is None or task in NEXT_TOKEN_TASKS or task in TASKS or Path(task).expanduser().is_file():
        return
    if Path(task).expanduser().exists():
        raise InputError(f"{{task}} {task}: a folder, not a CSV/JSONL file", parameter="task")
    if any(c in task for c in "/\\."):
        raise InputError(f"{{task}} {task}: no such file", parameter="task")
    raise InputError(
        f"unknown task {task!r}; tasks: {', '.join(TASKS)}, {', '.join(NEXT_TOKEN_TASKS)} (causal LMs), "
        "or a CSV/JSONL file path"
    )


def load_evaluation_task(
    task: str | None, model: ModelLike, label_names: list[str], text_column: str, label_column: str
):
    """``(LabelledTexts of the held-out examples, task name)``: a built-in task's 20 % held-out split
    (the classifier never trained on it), or every row of a user's CSV/JSONL file."""
    from attnflow.datasets import TASKS, load_labelled_file, load_task

    probe = getattr(model, "probe", None) or {}
    task = task or probe.get("task")
    if task is None:
        raise InputError(
            f"model {model.name!r} has no default task; give {{task}} ({', '.join(TASKS)} or a CSV/JSONL file)",
            parameter="task",
        )
    if task in TASKS:
        data = load_task(task)
        if [name.lower() for name in data.label_names] != [name.lower() for name in label_names]:
            raise InputError(
                f"task {task!r} has classes ({', '.join(data.label_names)}) but model {model.name!r} predicts "
                f"({', '.join(label_names)})"
            )
        return data.subset(data.split()[1]), task
    check_task_name(task)
    return load_labelled_file(task, tuple(label_names), text_column, label_column), task


def classification_task(
    model: ModelLike, task: str | None, samples: int | None, seed: int, text_column: str, label_column: str
) -> tuple[tuple[str, ...], np.ndarray, dict[str, Any]]:
    """``(texts, labels, run info)`` of a classifier's evaluation task, ``samples`` of them."""
    from attnflow.datasets import TASKS

    label_names = check_classifier(model)
    data, task_name = load_evaluation_task(task, model, label_names, text_column, label_column)
    data = data.subset(select_samples(len(data), samples, seed))
    probe = getattr(model, "probe", None) or {}
    run_info = {
        "model": model.name,
        "task": task_name,
        "labels": label_names,
        "classifier_heldout_accuracy": probe.get("heldout_accuracy"),
        "majority_accuracy": probe.get("majority_accuracy"),
        "samples": len(data),
        "split": "held-out 20 % (stratified, seed 0)" if task_name in TASKS else "all rows of the file",
    }
    return data.texts, data.labels, run_info


def next_token_task(
    model: ModelLike, task: str, window: int, samples: int | None, seed: int
) -> tuple[tuple[str, ...], np.ndarray, dict, list[tuple[int, int]] | None]:
    """``(texts, true next token ids, run info, key spans or None)`` of a causal LM's task,
    ``samples`` of them: ``next-token``, windows of ``window`` tokens of the held-out texts;
    ``next-token-probes``, prompts of about ``window`` tokens whose answer depends on one earlier
    token (`attnflow.datasets.next_token_probes`), those the model answers (its top-1 next token is
    the intended one) kept, with the character span of that token in each (its "key")."""
    from attnflow.datasets import TASKS, next_token_probes, next_token_windows

    if model.target_kind != "next_token":
        raise InputError(
            f"{{task}} {task} explains a causal language model's next token; {model.name} is not one "
            "(try {model} smollm2)",
            parameter=("task", "model"),
        )
    run_info: dict[str, Any] = {"model": model.name, "task": task, "window": window, "target": "next_token"}
    if task == NEXT_TOKEN_TASK:
        data = next_token_windows(model.tokenizer, window)
        data = data.subset(select_samples(len(data), samples, seed))
        split = f"one {window}-token window per held-out text (20 %) of {', '.join(TASKS)}, at a seeded offset"
        return data.texts, data.next_ids, {**run_info, "samples": len(data), "split": split}, None
    try:
        probes = next_token_probes(model.tokenizer, window)
    except InputError as error:  # its context is evaluate's window
        raise error.renamed({"context": "window"}) from None
    answered = _answered(model, probes.texts, probes.next_ids)
    kept = probes.subset(np.flatnonzero(answered))
    if not len(kept):
        raise InputError(f"{model.name} answers none of the {len(probes)} probes: nothing to explain")
    data = kept.subset(select_samples(len(kept), samples, seed))
    kinds = {kind: sum(k == kind for k in data.kinds) for kind in dict.fromkeys(probes.kinds)}
    asked = {kind: sum(k == kind for k in probes.kinds) for kind in kinds}
    split = (
        f"probes of about {window} tokens whose answer depends on one earlier token (the key); kept: the "
        f"{len(kept)} of {len(probes)} the model answers ("
        + ", ".join(f"{kind} {sum(k == kind for k in kept.kinds)}/{asked[kind]}" for kind in kinds)
        + ")"
    )
    return (
        data.texts,
        data.next_ids,
        {**run_info, "samples": len(data), "split": split, "kinds": kinds},
        list(data.keys),
    )


def _answered(model: ModelLike, texts: Sequence[str], answers: np.ndarray) -> np.ndarray:
    """``[text]`` whether the model's top-1 next token after each text is its intended answer."""
    from attnflow.evaluate.scorer import ClassifierScorer

    ids = model.tokenizer(list(texts), truncation=True, max_length=model.max_length)["input_ids"]
    return ClassifierScorer(model).probabilities(ids).argmax(axis=1) == np.asarray(answers)


def key_ranks(model: ModelLike, texts: Sequence[str], keys: Sequence[tuple[int, int]], scores: Sequence) -> list[int]:
    """Per text, the rank a method's ``scores [token]`` give its key (`metrics.key_rank`): the first
    token whose characters overlap the key span, among the content tokens."""
    from attnflow.evaluate.metrics import key_rank

    tokenizer = model.tokenizer
    ranks = []
    for text, (start, end), vector in zip(texts, keys, scores, strict=True):
        encoded = tokenizer(text, truncation=True, max_length=model.max_length, return_offsets_mapping=True)
        special = tokenizer.get_special_tokens_mask(encoded["input_ids"], already_has_special_tokens=True)
        key = [a < end and b > start for a, b in encoded["offset_mapping"]]
        ranks.append(key_rank(np.asarray(vector), np.asarray(special, dtype=bool), np.asarray(key)))
    return ranks


def _add_key_ranks(results: dict[str, Any], model: ModelLike, texts: Sequence[str], keys: Sequence, out: Path) -> None:
    """Each method's ``key`` figures on the probes: the share of probes whose map ranks the key
    first (``first``, with its standard error) and the mean rank of the key."""
    from attnflow.evaluate.benchmark import METHODS_DIR
    from attnflow.statistics import mean_se

    for method, summary in results["methods"].items():
        record = json.loads((out / METHODS_DIR / f"{method}.json").read_text(encoding="utf-8"))["record"]
        ranks = np.asarray(key_ranks(model, texts, keys, record["scores"]), dtype=np.float64)
        first, first_se = mean_se(ranks == 1)
        summary["key"] = {"first": float(first), "first_se": float(first_se), "mean_rank": float(ranks.mean())}


def evaluate(
    model: str | Any = "minilm-sentiment",
    task: str | None = None,
    methods: str | Sequence[str] = DEFAULT_METHODS,
    samples: int | None = None,
    out: str | Path = "out/evaluate",
    options: BenchmarkOptions | None = None,
    resume: bool = False,
    progress: bool = True,
    text_column: str = "text",
    label_column: str = "label",
    figures: bool = True,
    overwrite: bool = False,
    window: int = DEFAULT_WINDOW,
    *,
    engine: EngineOptions | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Run the benchmark and write ``results.json``, ``results.md``, figures and ``results.html``.

    ``model`` is an alias/path or an `AttentionModel` of a classifier; ``task`` a built-in task
    (default: the one the classifier was trained on) or a CSV/JSONL path with ``text_column`` and
    ``label_column``. ``samples``: examples drawn (None: up to `DEFAULT_SAMPLES`, all of a smaller
    set). ``methods``: names, ``"default"`` or ``"all"`` (`resolve_methods`). For a causal LM,
    ``task="next-token"``: windows of ``window`` tokens of the held-out texts
    (`attnflow.datasets.next_token_windows`), or ``"next-token-probes"``: prompts whose answer
    depends on one earlier token (`next_token_task`; each method also gets ``key``: how often its map
    ranks that token first); the target the model's top-1 next token, deletion removing context
    tokens. Returns the results dictionary (as in ``results.json``).

    The run is checkpointed in ``out`` as it goes (`attnflow.runs.engine`; ``engine``: local by
    default, or Ray actors, and the device a model named by ``model`` loads on). ``out`` holding an
    earlier run: ``resume`` continues it (the same run only: a changed option is refused, naming it,
    before the model loads), ``overwrite`` deletes its results first; neither raises InputError.
    ``dtype``: the precision a model named by ``model`` loads in (`attnflow.load`; a loaded model
    keeps its own).
    """
    from attnflow.evaluate.report import write_report
    from attnflow.model import load
    from attnflow.notebook import Results

    options = options or BenchmarkOptions()
    engine = engine or EngineOptions(quiet=not progress)
    config = {
        "model": model if isinstance(model, str) else model.name,
        "dtype": dtype if isinstance(model, str) else model_dtype(model),
        "task": task,
        "methods": methods if isinstance(methods, str) else list(methods),
        "samples": samples,
        "window": window if task in NEXT_TOKEN_TASKS else None,
        "columns": [text_column, label_column] if task not in (None, *NEXT_TOKEN_TASKS) else None,
        "options": asdict(options),
    }
    with RunFolder(
        out, kind="evaluate", checkpoint=CHECKPOINT, owned=is_evaluate_output, state_format=CHECKPOINT_FORMAT,
        resume=resume, overwrite=overwrite, fields=config,
    ) as folder:  # fmt: skip
        if isinstance(model, str):
            model = load(model, device=engine.driver_device, dtype=dtype)
        method_names = resolve_methods(methods, getattr(model, "adapter", None), model.target_kind)
        keys = None
        if task in NEXT_TOKEN_TASKS:
            texts, labels, run_info, keys = next_token_task(model, task, window, samples, options.seed)
        else:
            texts, labels, run_info = classification_task(model, task, samples, options.seed, text_column, label_column)
        run_info["methods"] = method_names
        began = time.perf_counter()
        results = run_benchmark(
            model, texts, labels, method_names, options, folder.out, run_info, resume=resume, progress=progress,
            engine=engine, config=config,
        )  # fmt: skip
        if keys is not None:
            _add_key_ranks(results, model, texts, keys, folder.out)
        results["run"]["wall_seconds"] = time.perf_counter() - began
        with atomic_file(folder.out / RESULTS_JSON) as handle:
            handle.write(json.dumps(results, indent=2).encode("utf-8"))
        write_report(results, folder.out, figures=figures)
    return Results("evaluate", results)
