"""Targets: what gradient and perturbation methods explain, asked for with one `Target`.

A `Target` says *what* to explain; the library takes it as one ``target=`` argument everywhere
(`model.explain`, `model.trace`, the explorer, `attnflow compare`, activation patching, the server),
and `as_target` is the one place that turns what a caller gives (a `Target`, a class index or name, a
token string or id, None for the prediction) into one. Its kinds, each an objective of the registry
`OBJECTIVES` (`register_objective` adds one):

- ``"class"`` (classifiers, ``logits [batch, class]``): the logit of class c; default the predicted
  class, or an index, or a label name;
- ``"next_token"`` (causal LMs): log p(next token = t | text) at the last real position; default the
  argmax token, or a token string (one token) or id;
- ``"similarity"`` (a sentence encoder without a head): cosine(embedding(text), embedding(``text=``))
  with the model's own mean pooling (read from its sentence-transformers config); an encoder without
  such pooling is refused;
- ``"steps"`` (a causal LM's generation): one y per step, log p(token_k) at the position that
  predicts it (`attnflow.generation`).

A **contrast** (classes and tokens: a second class, or a single token) turns y into
logit(target) − logit(contrast) ("why Paris rather than Rome"; for a causal LM log p(a) − log p(b),
the same number: the softmax normaliser cancels). Gradient methods then explain the difference,
and per-input faithfulness drops p(target) − p(contrast).

An `Objective` computes y from a forward pass (differentiably, so methods can take gradients);
`ResolvedTarget` records what was explained: kind, index, label, value. Torch is imported on first
use: reading a `ResolvedTarget` (reports, JSON) does not need it.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.shared_prefix import last_positions

if TYPE_CHECKING:
    import torch

    from attnflow.trace import Trace

TARGET_KINDS = ("class", "next_token", "similarity", "steps")


@dataclass(frozen=True)
class Target:
    """What to explain (the one target spec; `as_target` makes one from a plain value).

    label: a class index or name (classifiers), a token string (one token) or id (causal LMs); None:
    the prediction. text: sentence encoders, the text the similarity is to. contrast: a second class
    or token; y becomes logit(label) − logit(contrast). kind: None, the model's own kind of target
    (``model.target_kind``), or a kind of `OBJECTIVES` (``"steps"``: `Target.steps`). positions /
    tokens: ``"steps"`` only, the position that predicts each step's token and the token.
    """

    label: int | str | None = None
    text: str | None = None
    contrast: int | str | None = None
    kind: str | None = None
    positions: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    @classmethod
    def steps(cls, positions: Sequence[int], tokens: Sequence[int], contrast: int | str | None = None) -> Target:
        """A generation's steps: y_k = log p(``tokens[k]``) at ``positions[k]`` (− log p(contrast))."""
        return cls(
            contrast=contrast,
            kind="steps",
            positions=tuple(int(p) for p in positions),
            tokens=tuple(int(t) for t in tokens),
        )

    @property
    def given(self) -> bool:
        """Whether anything beyond the default (the model's prediction) is asked for."""
        return self != Target()

    def objective(self, model: ModelLike) -> Objective:
        """The `Objective` that computes y for this target on ``model`` (from `OBJECTIVES`)."""
        kind = self.kind or target_kind(model)
        if kind not in OBJECTIVES:
            raise InputError(f"unknown kind of target {kind!r}; known: {', '.join(OBJECTIVES)}", parameter="target")
        return OBJECTIVES[kind](model, self)


def as_target(
    target: Target | int | str | None = None, *, text: str | None = None, contrast: int | str | None = None
) -> Target:
    """The one conversion of what a caller gives into a `Target`: a `Target` as it is, a class index or
    name, a token string or id (``label``), or None (the prediction); ``text`` and ``contrast`` (the
    command line's and the JSON bodies' separate fields) join it. A `Target` given together with
    ``text`` or ``contrast`` is refused: say it in the Target."""
    if isinstance(target, Target):
        if text is not None or contrast is not None:
            raise InputError(
                "give the target text and the contrast inside the Target (Target(text=..., contrast=...)), "
                "not beside it",
                parameter="target",
            )
        return target
    if target is not None and not isinstance(target, (int, str)):
        raise InputError(
            f"{{target}} must be a Target, a class or token (index or name), or None; got {type(target).__name__}",
            parameter="target",
        )
    return Target(label=target, text=text, contrast=contrast)


def legacy_target(target: Any, target_text: str | None, contrast: int | str | None, where: str) -> Target:
    """`as_target` for a front door that still takes the loose ``target_text=`` / ``contrast=``
    arguments: they are deprecated spellings of ``target=Target(text=..., contrast=...)``."""
    if target_text is not None or contrast is not None:
        warnings.warn(
            f"{where}: target_text= and contrast= are deprecated; pass target=Target(text=..., contrast=...)",
            DeprecationWarning,
            stacklevel=3,
        )
    return as_target(target, text=target_text, contrast=contrast)


@dataclass(frozen=True)
class ResolvedTarget:
    """What an explanation is about, once resolved on the input.

    kind: ``"class"``, ``"next_token"`` or ``"similarity"``; index: class index or token id
    (None for similarity); label: class name, token string or the target text; value: y on the
    unaltered input (logit, log-probability, cosine, or the logit difference with a contrast);
    probability: p(class) or p(token), None for similarity; contrast_index / contrast_label: the
    class or token the target is contrasted with (None: no contrast).
    """

    kind: str
    index: int | None
    label: str | None
    value: float
    probability: float | None = None
    contrast_index: int | None = None
    contrast_label: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def request(self) -> Target:
        """The `Target` that asks for exactly this (to score altered inputs for the same output)."""
        if self.kind == "similarity":
            return Target(text=self.label, kind="similarity")
        return Target(label=self.index, contrast=self.contrast_index, kind=self.kind)

    def describe(self) -> str:
        """``negative (p = 0.83)``, ``next token ' Paris' (p = 0.41)``, ``similarity to '…' = 0.62``;
        with a contrast ``next token ' Paris' rather than ' Rome' (p = 0.41; logit difference 3.20)``."""
        if self.contrast_label is not None:
            shown = repr(self.label) if self.kind == "next_token" else self.label
            other = repr(self.contrast_label) if self.kind == "next_token" else self.contrast_label
            what = "next token " if self.kind == "next_token" else ""
            return f"{what}{shown} rather than {other} (p = {self.probability:.2f}; logit difference {self.value:.2f})"
        if self.kind == "class":
            return f"{self.label} (p = {self.probability:.2f})"
        if self.kind == "next_token":
            return f"next token {self.label!r} (p = {self.probability:.2f})"
        return f"similarity to {self.label!r} = {self.value:.3f}"


def target_kind(model: ModelLike) -> str:
    """Which target an `AttentionModel` supports (see the module docstring)."""
    if model.target_kind is None:
        raise InputError(
            f"{model.name} is a {model.kind} model: targets (and the methods that need one) are available for "
            "classifiers, causal LMs and sentence encoders"
        )
    return str(model.target_kind)


# -- the objectives ------------------------------------------------------------------------------

OBJECTIVES: dict[str, Callable[[ModelLike, Target], Objective]] = {}


def register_objective(kind: str) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator: ``kind``'s objective (built as ``cls(model, target)``)."""

    def add(cls: type[Objective]) -> type[Objective]:
        cls.kind = kind
        OBJECTIVES[kind] = cls
        return cls

    return add


class Objective:
    """y for a batch, for one model and one `Target`: `__call__` runs the whole model and returns
    ``(y [batch], index [batch] or None, probability [batch] or None)``; `choices` and `pick` split that
    in two, so that a method can score many inputs in one pass and fix the class or token afterwards
    (from the unaltered input). ``fixed_index``: the class or token the target names (None: the
    prediction); ``contrast_index``: the contrast's."""

    kind: ClassVar[str] = ""
    # y reads the last real token's logits of a causal LM: an edited input's shared start can come
    # from a key/value cache (`attnflow.shared_prefix`); `choices` then takes the rest of its tokens
    reads_last_token: ClassVar[bool] = False

    def __init__(self, model: ModelLike, target: Target) -> None:
        self.model = model
        self.target = target
        self.fixed_index: int | None = None
        self.contrast_index: int | None = None

    @classmethod
    def for_target(cls, model: ModelLike, target: ResolvedTarget) -> Objective:
        """The objective that scores altered inputs for an already resolved target."""
        return target.request().objective(model)

    def __call__(
        self,
        attention_mask: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One full forward pass: ``(y [batch], index [batch] or None, probability [batch] or None)``.

        ``index`` fixes the class or token per sample (perturbation methods pass the one resolved on
        the unaltered input); otherwise the target's own or the argmax is used."""
        return self.pick(
            self.choices(attention_mask, input_ids=input_ids, inputs_embeds=inputs_embeds, **model_kwargs), index
        )

    def choices(
        self,
        attention_mask: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """One forward pass: what y is picked from, ``[batch, choice]`` (class logits, next-token
        log-probabilities, or ``[batch, 1]`` similarities)."""
        inputs = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, **self.forward_options(), **model_kwargs}
        return self.read(self.model.hf_model(attention_mask=attention_mask, **inputs), attention_mask)

    def forward_options(self) -> dict[str, Any]:
        """Keyword arguments of the forward pass an objective adds (which logits to compute)."""
        return {}

    def read(self, outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        """`choices` from the model's outputs for a batch."""
        raise NotImplementedError

    def pick(
        self, choices: torch.Tensor, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(y, index, probability)`` from `choices` (``index``: as in `__call__`)."""
        raise NotImplementedError

    def describe(self, y: float, index: int | None, probability: float | None) -> ResolvedTarget:
        """What one output's target was, from its numbers."""
        raise NotImplementedError

    # -- naming classes and tokens -----------------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        id2label = getattr(self.model.hf_model.config, "id2label", None) or {}
        return [str(id2label[i]) for i in sorted(id2label)]

    def label_of(self, index: int) -> str:
        """A class's name or a token's text."""
        return self.labels[index] if self.kind == "class" else self.model.tokenizer.decode([index])


class _ChoiceObjective(Objective):
    """Classes and next tokens: y is the chosen entry of `choices` (minus the contrast's); p is the
    softmax of the choices (logits), or the exponential of the chosen one (log-probabilities)."""

    log_probabilities: ClassVar[bool] = False

    def __init__(self, model: ModelLike, target: Target) -> None:
        super().__init__(model, target)
        if target.text is not None:
            raise InputError(
                f"{{target_text}} is for sentence encoders; {model.name} has a {self.kind.replace('_', '-')} target",
                parameter="target_text",
            )
        if target.label is not None:
            self.fixed_index = self._index(target.label, "target")
        if target.contrast is not None:
            self.contrast_index = self._index(target.contrast, "contrast")
            if self.contrast_index == self.fixed_index:
                raise InputError(
                    f"the {{contrast}} {target.contrast!r} is the target itself: choose another class or token",
                    parameter="contrast",
                )

    def _index(self, value: int | str, role: str) -> int:
        raise NotImplementedError

    def pick(
        self, choices: torch.Tensor, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        import torch

        if index is None:
            index = (
                torch.full((len(choices),), self.fixed_index, device=choices.device)
                if self.fixed_index is not None
                else choices.argmax(dim=-1)
            )
        index = index.to(choices.device)
        chosen = choices.gather(1, index[:, None])[:, 0]  # [batch]
        probability = (
            chosen.exp() if self.log_probabilities else torch.softmax(choices, dim=-1).gather(1, index[:, None])[:, 0]
        )
        if self.contrast_index is not None:
            chosen = chosen - choices[:, self.contrast_index]
        return chosen, index, probability

    def describe(self, y: float, index: int | None, probability: float | None) -> ResolvedTarget:
        if index is None or probability is None:
            raise ValueError(f"a {self.kind} target needs its index and probability")
        contrast_label = None if self.contrast_index is None else self.label_of(self.contrast_index)
        kind = "next_token" if self.kind == "steps" else self.kind
        label = self.label_of(index)
        contrast = self.contrast_index
        return ResolvedTarget(kind, int(index), label, float(y), float(probability), contrast, contrast_label)


@register_objective("class")
class ClassObjective(_ChoiceObjective):
    """A classifier's logit of class c (``logits [batch, class]``)."""

    def _index(self, value: int | str, role: str) -> int:
        labels = self.labels
        parameter = "target" if role == "target" else "contrast"
        if isinstance(value, str) and not value.lstrip("-").isdigit():
            if value not in labels:
                raise InputError(
                    f"unknown class {value!r} ({{{parameter}}}); {self.model.name} has the classes {', '.join(labels)}",
                    parameter=parameter,
                )
            return labels.index(value)
        index = int(value)
        if not 0 <= index < len(labels):
            raise InputError(
                f"class index {index} out of range ({{{parameter}}}): {self.model.name} has {len(labels)} classes "
                f"({', '.join(labels)})",
                parameter=parameter,
            )
        return index

    def read(self, outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:  # noqa: ARG002 - every row
        return outputs.logits


class _TokenObjective(_ChoiceObjective):
    """Objectives over a causal LM's vocabulary (log-probabilities): targets and contrasts are single tokens."""

    log_probabilities = True

    @property
    def keeps_logits(self) -> bool:
        """Whether the model computes the logits of chosen positions only (``logits_to_keep``)."""
        return "logits_to_keep" in inspect.signature(self.model.hf_model.forward).parameters

    def _index(self, value: int | str, role: str) -> int:
        tokenizer = self.model.tokenizer
        parameter = "target" if role == "target" else "contrast"
        if isinstance(value, int):
            vocabulary = getattr(self.model.hf_model.config, "vocab_size", None) or len(tokenizer)
            if not 0 <= value < vocabulary:
                raise InputError(
                    f"token id {value} out of range ({{{parameter}}}; vocabulary of {vocabulary})", parameter=parameter
                )
            return value
        ids = tokenizer(value, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            raise InputError(
                f"the {role} token {value!r} is {len(ids)} tokens ({pieces}); give exactly one token ({{{parameter}}})",
                parameter=parameter,
            )
        return int(ids[0])


@register_objective("next_token")
class NextTokenObjective(_TokenObjective):
    """A causal LM's log p(next token = t | text) at the last real position (right padding). Where
    the model can, it computes the logits of those positions only (a batch of equal lengths: one
    position, not ``[batch, token, vocabulary]``). With a key/value cache of k tokens in
    ``model_kwargs``, ``attention_mask`` covers them and the input's tokens come after them."""

    reads_last_token = True

    def choices(
        self,
        attention_mask: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        import torch

        given = input_ids if input_ids is not None else inputs_embeds
        assert given is not None, "choices needs input_ids or inputs_embeds"
        last = last_positions(attention_mask, given.shape[1])  # [batch] last real position (right padding)
        kept = torch.unique(last)  # [positions] sorted
        if self.keeps_logits:
            model_kwargs = {"logits_to_keep": kept, **model_kwargs}
        inputs = {"input_ids": input_ids, "inputs_embeds": inputs_embeds, **model_kwargs}
        logits = self.model.hf_model(attention_mask=attention_mask, **inputs).logits  # [batch, kept or token, vocab]
        column = torch.searchsorted(kept, last) if self.keeps_logits else last
        return torch.log_softmax(logits[torch.arange(len(last)), column], dim=-1)  # [batch, vocab]


@register_objective("steps")
class StepsObjective(_TokenObjective):
    """One sequence, one y per step: y_k = log p(``tokens[k]``) at ``positions[k]`` (the logits of those
    positions only, where the model can skip the others), minus log p(contrast) with a contrast.
    `choices` are ``[step, vocab]``; the index is always the steps' own tokens."""

    def __init__(self, model: ModelLike, target: Target) -> None:
        import torch

        super().__init__(model, Target(contrast=target.contrast, kind="steps"))
        self.target = target
        self.positions = torch.as_tensor(list(target.positions), device=model.device)
        self.tokens = torch.as_tensor(list(target.tokens), device=model.device)

    def forward_options(self) -> dict[str, Any]:
        return {"logits_to_keep": self.positions} if self.keeps_logits else {}

    def read(self, outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:  # noqa: ARG002 - one sequence
        import torch

        logits = outputs.logits[0] if self.keeps_logits else outputs.logits[0, self.positions]
        return torch.log_softmax(logits, dim=-1)  # [step, vocab]

    def pick(
        self, choices: torch.Tensor, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return super().pick(choices, self.tokens if index is None else index)


@register_objective("similarity")
class SimilarityObjective(Objective):
    """A sentence encoder's cosine(mean-pooled embedding of the text, that of ``Target.text``)."""

    def __init__(self, model: ModelLike, target: Target) -> None:
        super().__init__(model, target)
        self._reference: torch.Tensor | None = None
        if target.label is not None:
            raise InputError(
                f"{model.name} is a sentence encoder without a classifier: give {{target_text}}, not {{target}}",
                parameter=("target_text", "target"),
            )
        if target.contrast is not None:
            raise InputError(
                f"{model.name} compares texts (similarity): a {{contrast}} is for classes or next tokens",
                parameter="contrast",
            )
        text = target.text
        if not isinstance(text, str) or not text.strip():
            raise InputError(
                f"{model.name} is a sentence encoder without a classifier head: this method explains the "
                "similarity to a target text; give one ({target_text})",
                parameter="target_text",
            )
        if model.default_row != "mean":
            raise InputError(
                f"{model.name} has no sentence-embedding pooling (a sentence-transformers mean-pooling "
                "config): {target_text} needs a sentence encoder such as minilm or mpnet",
                parameter="target_text",
            )
        self.text: str = text
        self._reference_embedding()  # now, never inside a caller's capture hooks

    def read(self, outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        import torch

        pooled = self._pool(outputs.last_hidden_state, attention_mask)
        return torch.nn.functional.cosine_similarity(pooled, self._reference_embedding(), dim=-1)[:, None]

    def pick(
        self,
        choices: torch.Tensor,
        index: torch.Tensor | None = None,  # noqa: ARG002 - a similarity has no class or token
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return choices[:, 0], None, None

    def describe(
        self,
        y: float,
        index: int | None,  # noqa: ARG002 - a similarity has no class or token ...
        probability: float | None,  # noqa: ARG002 - ... and no probability
    ) -> ResolvedTarget:
        return ResolvedTarget("similarity", None, self.text, float(y))

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, token, d_model]`` → ``[batch, d_model]``: the sentence encoder's mean pooling."""
        weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def _reference_embedding(self) -> torch.Tensor:
        """``[1, d_model]`` the pooled embedding of the target text."""
        import torch

        if self._reference is None:
            encoded = self.model.tokenizer(
                [self.text], truncation=True, max_length=self.model.max_length, return_tensors="pt"
            ).to(self.model.device)
            with torch.no_grad():
                hidden = self.model.hf_model(**encoded).last_hidden_state
            self._reference = self._pool(hidden, encoded["attention_mask"])
        return self._reference


# -- traces whose target a method resolves ----------------------------------------------------------


def objective_of(model: ModelLike, trace: Trace) -> Objective:
    """The objective a method that re-runs the model scores ``trace`` with: for its resolved target,
    or, for a trace whose target is still to resolve (``trace.request``: the capture ran no forward
    pass), for the `Target` asked for. A trace with neither raises ValueError."""
    if trace.target is not None:
        return Objective.for_target(model, trace.target)
    if trace.request is not None:
        return as_target(trace.request).objective(model)
    raise ValueError("this method needs the trace's target: use model.explain(text, method=...)")


def same_objective_groups(traces: Sequence[Trace]) -> list[list[int]]:
    """Positions of ``traces`` grouped so that each group is scored by one `Objective` (resolved
    targets of the same kind, and for similarity the same target text — classes and tokens may
    differ, they are the per-sample ``index`` —, or the same `Target` still to resolve), in order of
    first appearance. A trace without a target raises ValueError."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for position, trace in enumerate(traces):
        target = trace.target
        if target is not None:
            text = target.label if target.kind == "similarity" else None
            key: tuple[Any, ...] = ("resolved", target.kind, text)
        elif trace.request is not None:
            key = ("requested", trace.request)
        else:
            raise ValueError("this method needs the trace's target: use model.explain(text, method=...)")
        groups.setdefault(key, []).append(position)
    return list(groups.values())
