"""Explaining what a causal LM generates: every continuation token attributed to what came before it.

A prompt of P tokens and a continuation t_1 … t_N (greedy with ``max_new_tokens``, or given as
``continuation`` and scored by teacher forcing): step k explains y_k = log p(t_k | prompt, t_1 …
t_{k-1}) over its P + k − 1 sources. The sources of all steps are the prompt and t_1 … t_{N-1}
(S = P + N − 1 tokens); a `GenerationExplanation` holds the ``[step, source]`` matrix, zero
where a source lies at or after t_k's own position (causal), and log p(t_k), p(t_k) per step.

Each step is the registered method run unchanged on a trace of that step's prefix:

- methods that need no target and give a ``[query, key]`` matrix (rollout, raw, flow, norm,
  norm_rollout, ...) run once on the whole sequence; step k is the row of the position that
  predicts t_k (P + k − 2). A decoder's attention is causal, so that row is the last row of the
  same method on the prefix alone;
- methods that explain a target (grad_rollout, gradient, grad_x_input, integrated_gradients,
  leave_one_out, ...) get one trace per step, with target t_k. A causal LM's activations at a
  position do not depend on later tokens, so one forward pass over the sources serves a run of
  consecutive steps (step k reads its first P + k − 1 positions); gradient methods then take one
  backward pass per step, y_k alone, run as one batched backward (``torch.autograd.grad`` with
  ``is_grads_batched``), so each step receives exactly its own gradient. Methods that re-run the
  model (leave-one-out, integrated gradients) then batch their own forwards per step; methods with
  a batch form (``MethodSpec.batch``: leave-one-out, the LRP rules) take the traces of a pass at once.

Methods of neither kind (scores without a target, e.g. random) do not explain a generation.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from attnflow.capture.texts import check_texts
from attnflow.errors import ExplanationWarning, InputError
from attnflow.explanation import explain, explain_traces
from attnflow.methods.registry import AUTO, MethodSpec, available_methods, check_family, get_method, method_options
from attnflow.model_like import ModelLike
from attnflow.shared_prefix import cache_argument
from attnflow.trace import GRADIENT_NEEDS, TARGET_NEEDS, Trace, crop_field

JSON_FILE = "generation.json"
HTML_FILE = "generation.html"
PNG_FILE = "generation.png"
OUTPUT_FILES = (JSON_FILE, HTML_FILE, PNG_FILE)
# Steps per forward pass (and batched backward) of the target methods: the pass runs over the
# sources of the run's last step, so each of its steps pays for up to this many positions it does
# not use, and the batched backward holds one copy of the activations per step
# (benchmarks/bench_generation.py measured 4, 8, 12 and 32 against a per-step loop).
DEFAULT_STEPS_PER_PASS = 8


def explains_generations(spec: MethodSpec) -> bool:
    """Whether a method can explain generated tokens: it explains a target (run per step on the
    step copies), or it gives a ``[query, key]`` matrix from one forward pass (rows read per step)."""
    return spec.uses_target or (not spec.scores_only and spec.takes != "model")


def generation_methods() -> list[str]:
    """The registered methods that explain generations (see `explains_generations`)."""
    return [name for name in available_methods() if explains_generations(get_method(name))]


@dataclass
class GenerationExplanation:
    """One method's explanation of every continuation token.

    Attributes:
        sources: ``S = P + N − 1`` token strings, the prompt's then t_1 … t_{N-1}: the columns.
        generated: ``N`` token strings t_1 … t_N: the rows.
        token_ids: ``[P + N]`` ids of the prompt and the continuation.
        n_prompt: P, the prompt's tokens (special tokens such as a BOS included).
        special_mask: ``[P + N]`` bool, True for special tokens (never ranked as top sources).
        matrix: ``[N, S]`` row k: step k's scores over its ``P + k`` sources (0-based k), 0 beyond.
        log_probs: ``[N]`` y_k = log p(t_k | prompt, t_1 … t_{k-1}), what step k explains.
        method / options: the registered method and its options as used (defaults included).
        mode: ``"greedy"`` (generated here) or ``"teacher-forced"`` (a given continuation).
        continuation: the continuation as text (the tokenizer's decoding of t_1 … t_N).
        faithfulness: per-step comprehensiveness (`step_faithfulness`), or None.
        step_extras: per step, the numbers the method reported besides its scores
            (`attnflow.methods.extras`; LRP: ``conservation``, ...), or empty.
        notes: warnings the method raised (e.g. an integrated-gradients completeness error).
        contrast: the token every step's target was explained against (target methods explain
            log p(t_k) − log p(contrast)), or None.
        chosen_by: why ``--method auto`` showed this explanation (its mean comprehensiveness over
            the steps against the other candidates'), or None.
    """

    model: str
    method: str
    options: dict[str, Any]
    prompt: str
    sources: list[str]
    generated: list[str]
    token_ids: np.ndarray
    n_prompt: int
    special_mask: np.ndarray
    matrix: np.ndarray
    log_probs: np.ndarray
    mode: str
    continuation: str = ""
    faithfulness: dict[str, Any] | None = None
    step_extras: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    contrast: str | None = None
    chosen_by: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.special_mask = np.asarray(self.special_mask, dtype=bool)
        self.matrix = np.asarray(self.matrix, dtype=np.float64)
        self.log_probs = np.asarray(self.log_probs, dtype=np.float64)
        n, s = len(self.generated), len(self.sources)
        if s != self.n_prompt + n - 1 or self.token_ids.shape != (s + 1,) or self.special_mask.shape != (s + 1,):
            raise ValueError(f"{self.n_prompt} prompt and {n} generated tokens need {self.n_prompt + n - 1} sources")
        if self.matrix.shape != (n, s) or self.log_probs.shape != (n,):
            raise ValueError(f"matrix must be [step, source] = ({n}, {s}), got {self.matrix.shape}")

    @property
    def n_steps(self) -> int:
        return len(self.generated)

    @property
    def explains(self) -> str:
        """What each step's scores explain: ``each token`` or ``each token rather than ' Rome'``."""
        return "each token" + ("" if self.contrast is None else f" rather than {self.contrast!r}")

    @property
    def probabilities(self) -> np.ndarray:
        """``[N]`` p(t_k)."""
        return np.exp(self.log_probs)

    def n_sources(self, step: int) -> int:
        """How many sources step ``step`` (0-based) has: the prompt and the ``step`` tokens before it."""
        return self.n_prompt + step

    def step_scores(self, step: int) -> np.ndarray:
        """``[P + step]`` step ``step``'s scores (0-based), without the causally absent entries."""
        return self.matrix[step, : self.n_sources(step)]

    def top_sources(self, step: int, k: int = 3) -> list[tuple[int, str, float]]:
        """Step ``step``'s ``k`` highest-scoring sources as ``(index, token, score)``, special tokens left out."""
        scores = self.step_scores(step)
        order = [i for i in np.argsort(-scores, kind="stable") if not self.special_mask[i]]
        return [(int(i), self.sources[i], float(scores[i])) for i in order[:k]]

    # ----- showing and saving ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The content of ``generation.json``: ``matrix`` rows are ragged (row k has P + k entries)."""
        data: dict[str, Any] = {
            "model": self.model,
            "method": self.method,
            "options": json.loads(json.dumps(self.options, default=str)),
            "mode": self.mode,
            "prompt": self.prompt,
            "continuation": self.continuation,
            "contrast": self.contrast,
            "n_prompt": self.n_prompt,
            "sources": list(self.sources),
            "generated": list(self.generated),
            "token_ids": self.token_ids.tolist(),
            "special_mask": self.special_mask.tolist(),
            "matrix": [self.step_scores(step).tolist() for step in range(self.n_steps)],
            "steps": [
                {
                    "token": self.generated[step],
                    "log_prob": float(self.log_probs[step]),
                    "probability": float(self.probabilities[step]),
                    "top_sources": [
                        {"index": i, "token": token, "score": score} for i, token, score in self.top_sources(step)
                    ],
                }
                for step in range(self.n_steps)
            ],
        }
        for step, extras in enumerate(self.step_extras):
            if extras:
                data["steps"][step]["extras"] = extras
        if self.faithfulness is not None:
            data["faithfulness"] = self.faithfulness
        if self.notes:
            data["notes"] = list(self.notes)
        if self.chosen_by is not None:
            data["chosen_by"] = self.chosen_by
        return data

    def to_html(self) -> str:
        """A self-contained page: the [generated token × source] heatmap table (hover for numbers)."""
        from attnflow.viz.generation import generation_html

        return generation_html(self)

    def _repr_html_(self) -> str:
        from attnflow.viz.generation import generation_fragment

        return generation_fragment(self)

    def plot(self) -> Any:
        """A matplotlib Figure: the ``[step, source]`` heatmap (absent entries blank)."""
        from attnflow.viz.generation import generation_figure

        return generation_figure(self)

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write ``generation.json``, ``.html`` and ``.png`` into ``directory`` (created); returns the paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {"json": directory / JSON_FILE, "html": directory / HTML_FILE, "png": directory / PNG_FILE}
        paths["json"].write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")
        paths["html"].write_text(self.to_html(), encoding="utf-8")
        self.plot().savefig(paths["png"], dpi=110, bbox_inches="tight")
        return paths


@dataclass(frozen=True)
class Continuation:
    """A prompt and its continuation as token ids: ``ids [P + N]``, ``special [P + N]`` bool."""

    prompt: str
    ids: np.ndarray
    special: np.ndarray
    n_prompt: int
    mode: str

    @property
    def n_steps(self) -> int:
        return len(self.ids) - self.n_prompt

    @property
    def sources(self) -> np.ndarray:
        """``[S]`` the ids every step draws on: all but the last token."""
        return self.ids[:-1]

    @property
    def targets(self) -> np.ndarray:
        """``[N]`` t_1 … t_N."""
        return self.ids[self.n_prompt :]


def explain_generation(
    model: ModelLike,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    continuation: str | None = None,
    method: str | Sequence[str] = "rollout",
    faithfulness: bool = False,
    steps_per_pass: int = DEFAULT_STEPS_PER_PASS,
    contrast: int | str | None = None,
    **options: Any,
) -> Any:
    """Explain every token a causal LM generates after ``prompt`` (see the module docstring).

    Give ``max_new_tokens`` (greedy generation, stopping early at the end-of-sequence token) or
    ``continuation`` (teacher-forced, tokenized on its own). ``method``: a name, or a list of
    names (one explanation each, sharing the captures); ``options`` go to every method.
    ``faithfulness``: per step, p(t_k) after removing step k's top sources (`step_faithfulness`).
    ``steps_per_pass``: steps per forward pass (and batched backward) of the target methods.
    ``contrast``: a single token (string or id); every step's target methods then explain
    log p(t_k) − log p(contrast) = logit(t_k) − logit(contrast): why t_k rather than it.

        model = attnflow.load("smollm2")
        explanation = attnflow.explain_generation(model, "The capital of France is", max_new_tokens=8)
        explanation.top_sources(0)   # what the first generated token drew on
    """
    names = [method] if isinstance(method, str) else list(method)
    per_method = {name: method_options(check_generation_method(model, name), options) for name in names}
    sequence = prepare_continuation(model, prompt, max_new_tokens=max_new_tokens, continuation=continuation)
    explanations = explain_continuation(model, sequence, per_method, faithfulness, steps_per_pass, contrast)
    return explanations[0] if isinstance(method, str) else explanations


def plan_generation(model: ModelLike, methods: Sequence[str] | None, options: Mapping[str, Any] | None = None) -> Any:
    """What `attnflow explain PROMPT --generate N` (and the server's ``/api/generate``) computes:
    `attnflow.evaluate.per_input.plan_methods`'s plan (``methods`` None: ``auto``, whose candidates
    are target methods, so each explains generations; the user's ``options`` shared out among the
    methods), every method checked to explain generations on this model's family before anything
    runs."""
    from attnflow.evaluate.per_input import plan_methods

    plan = plan_methods(model, methods, dict(options or {}))
    for name in plan.per_method:
        check_generation_method(model, name)
    return plan


def explain_planned_generation(
    model: ModelLike,
    sequence: Continuation,
    plan: Any,
    faithfulness: bool = False,
    steps_per_pass: int = DEFAULT_STEPS_PER_PASS,
    contrast: int | str | None = None,
) -> list[GenerationExplanation]:
    """Every method of ``plan`` (`plan_generation`) on the continuation ``sequence``
    (`explain_continuation`), ``auto`` resolved: one explanation per method asked for, auto's
    choice in its place with its ``chosen_by``, each explanation once. ``auto`` computes every candidate's per-step
    faithfulness to choose (so every method gets it then)."""
    from attnflow.evaluate.per_input import choose_by_step_aopc

    computed = explain_continuation(
        model, sequence, plan.per_method, faithfulness or bool(plan.candidates), steps_per_pass, contrast
    )
    by_name = {explanation.method: explanation for explanation in computed}
    if plan.candidates:
        chosen, chosen_by = choose_by_step_aopc([by_name[name] for name in plan.candidates])
        chosen.chosen_by = chosen_by
        by_name[AUTO] = chosen
    return list({id(by_name[name]): by_name[name] for name in plan.requested}.values())


def check_generation_method(model: ModelLike, name: str) -> MethodSpec:
    """The method's registry entry, after checking that it explains generations on this model's family."""
    spec = get_method(name)
    if not explains_generations(spec):
        raise InputError(
            f"method {name!r} does not explain generated tokens; methods that do: {', '.join(generation_methods())}"
        )
    check_family(spec, model.adapter)
    return spec


def prepare_continuation(
    model: ModelLike, prompt: str, *, max_new_tokens: int | None = None, continuation: str | None = None
) -> Continuation:
    """The prompt's ids (a special token the tokenizer appends at the end, such as [SEP], dropped:
    the continuation follows the text) and the continuation's: generated greedily or tokenized."""
    if model.target_kind != "next_token":
        raise InputError(
            f"{model.name} is {'an' if model.kind[0] in 'aeiou' else 'a'} {model.kind} model: explaining generated "
            "tokens ({max_new_tokens} / {continuation}) needs a causal LM such as smollm2",
            parameter=("max_new_tokens", "continuation"),
        )
    if (max_new_tokens is None) == (continuation is None):
        raise InputError(
            "give either {max_new_tokens} (greedy) or {continuation} (teacher-forced), exactly one",
            parameter=("max_new_tokens", "continuation"),
        )
    check_texts(prompt)
    encoded = model.tokenizer(prompt, add_special_tokens=True, return_special_tokens_mask=True)
    ids, special = list(encoded["input_ids"]), [bool(s) for s in encoded["special_tokens_mask"]]
    while len(ids) > 1 and special[-1]:
        ids.pop()
        special.pop()
    if continuation is not None:
        check_texts(continuation)
        new = list(model.tokenizer(continuation, add_special_tokens=False)["input_ids"])
        mode = "teacher-forced"
    else:
        _check_new_tokens(model, max_new_tokens, len(ids))
        new = greedy_continuation(model, ids, int(max_new_tokens))  # type: ignore[arg-type]
        mode = "greedy"
    if len(ids) + len(new) > model.max_length:
        raise InputError(
            f"the prompt ({len(ids)} tokens) and the continuation ({len(new)} tokens) exceed {model.name}'s "
            f"context of {model.max_length} tokens"
        )
    special_ids = set(model.tokenizer.all_special_ids)
    return Continuation(
        prompt=prompt,
        ids=np.asarray(ids + new, dtype=np.int64),
        special=np.asarray(special + [token in special_ids for token in new], dtype=bool),
        n_prompt=len(ids),
        mode=mode,
    )


def _check_new_tokens(model: ModelLike, max_new_tokens: Any, n_prompt: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(
            f"{{max_new_tokens}} takes the number of new tokens, at least 1; got {max_new_tokens}",
            parameter="max_new_tokens",
        )
    room = model.max_length - n_prompt
    if max_new_tokens > room:
        raise InputError(
            f"{{max_new_tokens}} {max_new_tokens}: the prompt's {n_prompt} tokens and {max_new_tokens} new ones exceed "
            f"{model.name}'s context of {model.max_length} tokens (at most {max(room, 0)} new tokens)",
            parameter="max_new_tokens",
        )


def greedy_continuation(model: ModelLike, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Up to ``max_new_tokens`` greedy (argmax) tokens after ``prompt_ids``, with the model's key/value
    cache; it stops after an end-of-sequence token, as ``transformers``' greedy ``generate`` does."""
    import torch

    stop = model.hf_model.generation_config.eos_token_id
    stop = set() if stop is None else {stop} if isinstance(stop, int) else set(stop)
    cache_name = cache_argument(model)
    new: list[int] = []
    step_input = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            output = model.hf_model(input_ids=step_input, use_cache=True, **{cache_name: past})
            past = getattr(output, cache_name)
            token = int(output.logits[0, -1].argmax())
            new.append(token)
            if token in stop:
                break
            step_input = torch.as_tensor([[token]], dtype=torch.long, device=model.device)
    return new


def step_log_probs(model: ModelLike, sequence: Continuation) -> np.ndarray:
    """``[N]`` log p(t_k | prompt, t_1 … t_{k-1}) from one forward pass over the sources."""
    import torch

    sources = torch.as_tensor(sequence.sources[None], dtype=torch.long, device=model.device)
    with torch.no_grad():
        logits = model.hf_model(input_ids=sources).logits[0, sequence.n_prompt - 1 :]  # [N, vocab]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.as_tensor(sequence.targets, device=log_probs.device)
    return log_probs.gather(1, targets[:, None])[:, 0].cpu().numpy()


def explain_continuation(
    model: ModelLike,
    sequence: Continuation,
    per_method: Mapping[str, Mapping[str, Any]],
    faithfulness: bool = False,
    steps_per_pass: int = DEFAULT_STEPS_PER_PASS,
    contrast: int | str | None = None,
) -> list[GenerationExplanation]:
    """One `GenerationExplanation` per method (``{name: options}``, options already checked);
    ``contrast``: a token every step's target is explained against (see `explain_generation`)."""
    from attnflow.targets import Target

    contrast_id = None if contrast is None else Target(contrast=contrast).objective(model).contrast_index
    contrast_label = None if contrast_id is None else model.tokenizer.decode([contrast_id])
    specs = {name: get_method(name) for name in per_method}
    n, p, s = sequence.n_steps, sequence.n_prompt, len(sequence.sources)
    one_pass = [name for name, spec in specs.items() if not spec.uses_target]
    per_step = [name for name, spec in specs.items() if spec.uses_target]
    rows: dict[str, np.ndarray] = {name: np.zeros((n, s)) for name in per_method}
    notes: dict[str, list[str]] = {name: [] for name in per_method}
    used: dict[str, dict[str, Any]] = {}  # each method's options as used, defaults included
    extras: dict[str, list[dict[str, Any]]] = {name: [{} for _ in range(n)] for name in per_method}
    if one_pass:
        _explain_whole_sequence(model, sequence, one_pass, per_method, rows, notes, used)
    if per_step:
        log_probs = _explain_each_step(
            model, sequence, per_step, per_method, steps_per_pass, contrast_id, rows, notes, used, extras
        )
    else:
        log_probs = step_log_probs(model, sequence)
    tokens = token_strings(model, sequence.ids)
    explanations = []
    for name in per_method:
        explanation = GenerationExplanation(
            model=model.name,
            method=name,
            options=used[name],
            prompt=sequence.prompt,
            sources=tokens[:-1],
            generated=tokens[p:],
            token_ids=sequence.ids,
            n_prompt=p,
            special_mask=sequence.special,
            matrix=rows[name],
            log_probs=log_probs,
            mode=sequence.mode,
            continuation=model.tokenizer.decode(sequence.targets.tolist()),
            notes=notes[name],
            step_extras=extras[name] if any(extras[name]) else [],
            contrast=contrast_label if specs[name].uses_target else None,
        )
        if faithfulness:
            explanation.faithfulness = step_faithfulness(model, explanation)
        explanations.append(explanation)
    return explanations


def _explain_whole_sequence(
    model: ModelLike,
    sequence: Continuation,
    names: Sequence[str],
    per_method: Mapping[str, Mapping[str, Any]],
    rows: dict[str, np.ndarray],
    notes: dict[str, list[str]],
    used: dict[str, dict[str, Any]],
) -> None:
    """Methods without a target: one trace of the whole sequence, step k's row the matrix's row of
    the position before t_k (filled into ``rows[name] [step, source]``, ``notes`` and ``used``)."""
    n, p = sequence.n_steps, sequence.n_prompt
    needs = frozenset().union(*(get_method(name).needs for name in names))
    whole = sequence_trace(model, sequence, needs)
    for name in names:
        # the whole sequence's last row is no step's: each step's row is checked for a collapse instead
        explained = explain(whole, method=name, row="last", model=model, check_collapse=False, **per_method[name])
        matrix = explained.matrix  # [query, key]: a text's explanation always has its matrix
        assert matrix is not None
        for step in range(n):
            rows[name][step, : p + step] = matrix[p + step - 1, : p + step]
        notes[name] += explained.notes
        used[name] = explained.options
        say_step_notes(name, [[] for _ in range(n)], rows[name], sequence, model, notes[name])


def _explain_each_step(
    model: ModelLike,
    sequence: Continuation,
    names: Sequence[str],
    per_method: Mapping[str, Mapping[str, Any]],
    steps_per_pass: int,
    contrast_id: int | None,
    rows: dict[str, np.ndarray],
    notes: dict[str, list[str]],
    used: dict[str, dict[str, Any]],
    extras: dict[str, list[dict[str, Any]]],
) -> np.ndarray:
    """Target methods: each step explained for its own token, ``steps_per_pass`` steps a pass (filled
    into ``rows``, ``notes`` — each kind of note said once —, ``used`` and ``extras``). Returns
    ``[N]`` y_k = log p(t_k | before), read from the step traces' targets."""
    n, p = sequence.n_steps, sequence.n_prompt
    step_notes: dict[str, list[list[str]]] = {name: [[] for _ in range(n)] for name in names}
    log_probs = np.empty(n)
    needs = frozenset().union(*(get_method(name).needs for name in names))
    for start in range(0, n, max(1, steps_per_pass)):
        steps = range(start, min(n, start + max(1, steps_per_pass)))
        traces = step_traces(model, sequence, steps, needs, contrast_id)
        for step, trace in zip(steps, traces, strict=True):
            log_probs[step] = np.log(trace.target.probability)
        for name in names:
            with warnings.catch_warnings():  # each step's notes are kept, and said once per kind below
                warnings.simplefilter("ignore", ExplanationWarning)
                explained_steps = explain_traces(
                    traces, method=name, row="last", model=model, check_collapse=False, **per_method[name]
                )
            for step, explained in zip(steps, explained_steps, strict=True):
                rows[name][step, : p + step] = explained.scores
                extras[name][step] = explained.extras
                step_notes[name][step] = explained.notes
                used[name] = explained.options
    for name in names:
        say_step_notes(name, step_notes[name], rows[name], sequence, model, notes[name])
    return log_probs


def say_step_notes(
    name: str,
    step_notes: list[list[str]],
    rows: np.ndarray,
    sequence: Continuation,
    model: ModelLike,
    notes: list[str],
) -> None:
    """One rule for every method: each step's row ``rows [step, source]`` (the method's scores for
    t_k over its sources) is checked for a collapse on one token (`collapse_note`, as `explain`
    checks a text's saliency row), added to that step's notes ``step_notes``; then each kind of
    note is said once for the run (`condensed_notes`: its first step and the steps it concerns,
    naming the method) and appended to ``notes``."""
    from attnflow.errors import warn_once
    from attnflow.methods.diagnostics import collapse_note

    p = sequence.n_prompt
    sources = token_strings(model, sequence.ids)[:-1]
    for step, kept in enumerate(step_notes):
        collapse = collapse_note(
            rows[step, : p + step],
            sources[: p + step],
            own=p + step - 1,
            special_mask=sequence.special[: p + step],
            family=getattr(model, "adapter", None),
        )
        if collapse:
            kept.append(collapse)
    for note in condensed_notes(step_notes):
        warn_once(f"{name}: {note}", ExplanationWarning, about=name, stacklevel=3)
        notes.append(note)


def condensed_notes(step_notes: Sequence[Sequence[str]]) -> list[str]:
    """The notes of all steps (``step_notes[k]``: step k's), one per kind: notes that differ only in
    their numbers (e.g. "55 % of the relevance is on the first token") are one kind, given as its
    first step's note and the steps it concerns (1-based)."""
    kinds: dict[str, tuple[str, list[int]]] = {}  # kind -> (its first note, the steps with it)
    for step, notes in enumerate(step_notes):
        for note in notes:
            steps = kinds.setdefault(re.sub(r"\d+(?:\.\d+)?", "#", note), (note, []))[1]
            if step + 1 not in steps:
                steps.append(step + 1)
    total = len(step_notes)
    if total == 1:
        return [first for first, _ in kinds.values()]
    return [
        f"{first} (step {steps[0]}; this note on {len(steps)} of {total} steps: {_ranges(steps)})"
        for first, steps in kinds.values()
    ]


def _ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs)


def sequence_trace(model: ModelLike, sequence: Continuation, needs: frozenset[str]) -> Trace:
    """The trace of all the sources (the prompt and t_1 … t_{N-1}), captured in one forward pass:
    the one-pass methods read step k's (0-based) sources from its row P + k − 1, the position that
    predicts step k's token (the explorer's generation view reads it per layer)."""
    (trace,) = step_traces(model, sequence, [sequence.n_steps - 1], needs)  # the last step's: all S
    return trace


def step_traces(
    model: ModelLike, sequence: Continuation, steps: Sequence[int], needs: frozenset[str], contrast: int | None = None
) -> list[Trace]:
    """One `Trace` per step k of ``steps`` (0-based), over its ``P + k`` sources, with target t_k
    when ``needs`` asks for one (`attnflow.trace.TARGET_NEEDS`).

    One forward pass over the sources up to the last step's serves every step: a causal LM's
    activations at a position do not depend on later tokens, so the first ``P + k`` positions are
    those of the prefix alone. The gradient fields come from one backward pass per step (y_k
    alone), run as one batched backward over the steps."""
    import torch

    from attnflow.targets import Target

    n_prompt = sequence.n_prompt
    width = n_prompt + max(steps)
    ids = torch.as_tensor(sequence.sources[None, :width], dtype=torch.long, device=model.device)
    objective = None
    if needs & TARGET_NEEDS:
        positions = [n_prompt + step - 1 for step in steps]  # the position that predicts t_k
        objective = Target.steps(positions, sequence.targets[list(steps)].tolist(), contrast).objective(model)
    # name -> [1, ...], the gradient fields and "target" -> [step, ...]
    captured = model.capture_needs(
        needs, objective, separate_outputs=True, input_ids=ids, attention_mask=torch.ones_like(ids)
    )
    shared = model.shared_fields(needs)
    tokens = token_strings(model, sequence.sources[:width])
    traces = []
    for i, step in enumerate(steps):
        n = n_prompt + step
        per_step: dict[str, Any] = {
            name: crop_field(name, array[i if name in GRADIENT_NEEDS else 0], n)
            for name, array in captured.items()
            if name != "target"
        }
        traces.append(
            Trace(
                tokens=tokens[:n],
                token_ids=sequence.sources[:n].copy(),
                offsets=np.zeros((n, 2), dtype=np.int64),
                special_mask=sequence.special[:n].copy(),
                text=model.tokenizer.decode(sequence.sources[:n].tolist()),
                model_name=model.name,
                layer_names=list(model.layer_names),
                meta={"default_row": "last", **model.precision_meta()},
                target=captured["target"][i] if "target" in captured else None,
                **per_step,
                **shared,
            )
        )
    return traces


def token_strings(model: ModelLike, ids: np.ndarray) -> list[str]:
    """The tokenizer's spelling of each id; ``<id N>`` for an id the model has but the tokenizer
    lacks (a vocabulary padded past the tokenizer's, which greedy decoding can reach)."""
    tokens = model.tokenizer.convert_ids_to_tokens(ids.tolist())
    return [f"<id {i}>" if token is None else token for i, token in zip(ids.tolist(), tokens, strict=True)]


def step_faithfulness(model: ModelLike, explanation: GenerationExplanation, replace: str = "remove") -> dict[str, Any]:
    """Per step, p(t_k) once step k's top sources are gone, as `attnflow evaluate` measures
    comprehensiveness: the top ``ceil(f * m)`` of the m content sources removed (``replace="remove"``)
    or masked, for f in `attnflow.evaluate.metrics.BINS` (every removal keeps one token). Returns
    ``{"bins", "probability" [N], "perturbed_probability" [N, bin], "aopc" [N], "mean_aopc"}``."""
    import torch

    from attnflow.evaluate.metrics import BINS, aopc, content_ranking, top_count
    from attnflow.methods.deletion import without_top
    from attnflow.targets import Target

    tokenizer = model.tokenizer
    mask_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.pad_token_id
    variants, targets = [], []
    for step in range(explanation.n_steps):
        n = explanation.n_sources(step)
        ids = explanation.token_ids[:n].tolist()
        ranking = content_ranking(explanation.step_scores(step), explanation.special_mask[:n])
        for fraction in BINS:
            count = min(top_count(fraction, len(ranking)), n - 1)  # an empty input has no next token
            variants.append(without_top(ids, ranking, count, replace, mask_id))
            targets.append(int(explanation.token_ids[n]))
    width = max(len(variant) for variant in variants)
    padded = torch.full((len(variants), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(padded)
    for row, variant in enumerate(variants):
        padded[row, : len(variant)] = torch.as_tensor(variant)
        attention_mask[row, : len(variant)] = 1
    with torch.no_grad():
        _, _, probability = Target(kind="next_token").objective(model)(
            attention_mask.to(model.device),
            input_ids=padded.to(model.device),
            index=torch.as_tensor(targets, device=model.device),
        )
    assert probability is not None  # a next-token objective always gives p
    perturbed = probability.double().cpu().numpy().reshape(explanation.n_steps, len(BINS))
    _, per_step = aopc(explanation.probabilities, perturbed)
    return {
        "bins": list(BINS),
        "replace": replace,
        "probability": explanation.probabilities.tolist(),
        "perturbed_probability": perturbed.tolist(),
        "aopc": per_step.tolist(),
        "mean_aopc": float(per_step.mean()),
    }
