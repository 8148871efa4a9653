"""Targets: the scalar y that gradient and perturbation methods explain.

- a classifier (``logits [batch, class]``): the logit of class c; default the predicted class,
  or an index, or a label name;
- a causal LM: log p(next token = t | text) at the last real position; default the argmax token,
  or a token string (one token) or id;
- a sentence encoder without a head: cosine(embedding(text), embedding(target text)) with the
  model's own mean pooling (read from its sentence-transformers config); a target text is
  required, and an encoder without such pooling is refused.

A **contrast** (classifiers and causal LMs: a second class, or a single token) turns y into
logit(target) − logit(contrast) ("why Paris rather than Rome"; for a causal LM log p(a) − log p(b),
the same number: the softmax normaliser cancels). Gradient methods then explain the difference,
and per-input faithfulness drops p(target) − p(contrast).

`Objective` computes y from a forward pass (differentiably, so methods can take gradients), and
`Target` records what was explained: kind, index, label, value. Torch is imported on first use:
reading a `Target` (reports, JSON) does not need it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

from attnflow.errors import InputError
from attnflow.model_like import ModelLike

if TYPE_CHECKING:
    import torch

TARGET_KINDS = ("class", "next_token", "similarity")


@dataclass(frozen=True)
class Target:
    """What an explanation is about.

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


def same_objective_groups(targets: Sequence[Target | None]) -> list[list[int]]:
    """Positions of ``targets`` grouped so that each group is scored by one `Objective` (the same
    kind, and for similarity the same target text; classes and tokens may differ, they are the
    per-sample ``index``), in order of first appearance. A missing target raises ValueError."""
    groups: dict[tuple[str, str | None], list[int]] = {}
    for position, target in enumerate(targets):
        if target is None:
            raise ValueError("this method needs the trace's target: use model.explain(text, method=...)")
        text = target.label if target.kind == "similarity" else None
        groups.setdefault((target.kind, text), []).append(position)
    return list(groups.values())


def target_kind(model: ModelLike) -> str:
    """Which target an `AttentionModel` supports (see the module docstring)."""
    if model.target_kind is None:
        raise InputError(
            f"{model.name} is a {model.kind} model: targets (and the methods that need one) are available for "
            "classifiers, causal LMs and sentence encoders"
        )
    return str(model.target_kind)


class Objective:
    """y for a batch, given one model and what the user asked for.

    Args:
        model: an `AttentionModel`.
        target: class index or label name (classifiers), token string or id (causal LMs);
            None: the predicted class / the argmax token.
        target_text: sentence encoders: the text whose embedding y is the cosine similarity to.
        contrast: a class or a single token as ``target`` takes it: y becomes
            logit(target) − logit(contrast).
    """

    def __init__(
        self,
        model: ModelLike,
        target: int | str | None = None,
        target_text: str | None = None,
        contrast: int | str | None = None,
    ) -> None:
        self.model = model
        self.kind = target_kind(model)
        self.fixed_index: int | None = None
        self.contrast_index: int | None = None
        self._reference: torch.Tensor | None = None
        self.target_text = target_text
        if self.kind == "similarity":
            if target is not None:
                raise InputError(
                    f"{model.name} is a sentence encoder without a classifier: give --target-text, not --target"
                )
            if not isinstance(target_text, str) or not target_text.strip():
                raise InputError(
                    f"{model.name} is a sentence encoder without a classifier head: this method explains the "
                    "similarity to a target text; give one (--target-text / target_text=)"
                )
            if model.default_row != "mean":
                raise InputError(
                    f"{model.name} has no sentence-embedding pooling (a sentence-transformers mean-pooling "
                    "config): --target-text needs a sentence encoder such as minilm or mpnet"
                )
            self._reference_embedding()  # now, never inside a caller's capture hooks
        elif target_text is not None:
            raise InputError(
                f"--target-text is for sentence encoders; {model.name} has a {self.kind.replace('_', '-')} target"
            )
        elif target is not None:
            self.fixed_index = self._class_index(target) if self.kind == "class" else self._token_id(target)
        if contrast is not None:
            if self.kind == "similarity":
                raise InputError(f"{model.name} compares texts (similarity): a contrast is for classes or next tokens")
            self.contrast_index = (
                self._class_index(contrast) if self.kind == "class" else self._token_id(contrast, "contrast")
            )
            if self.contrast_index == self.fixed_index:
                raise InputError(f"the contrast {contrast!r} is the target itself: choose another class or token")

    @classmethod
    def for_target(cls, model: ModelLike, target: Target) -> "Objective":
        """The objective that scores altered inputs for an already resolved `Target`."""
        if target.kind == "similarity":
            return cls(model, target_text=target.label)
        return cls(model, target=target.index, contrast=target.contrast_index)

    # -- resolving what the user asked -----------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        id2label = getattr(self.model.model.config, "id2label", None) or {}
        return [str(id2label[i]) for i in sorted(id2label)]

    def _class_index(self, target: int | str) -> int:
        labels = self.labels
        if isinstance(target, str) and not target.lstrip("-").isdigit():
            if target not in labels:
                raise InputError(f"unknown class {target!r}; {self.model.name} has the classes {', '.join(labels)}")
            return labels.index(target)
        index = int(target)
        if not 0 <= index < len(labels):
            raise InputError(
                f"class index {index} out of range: {self.model.name} has {len(labels)} classes ({', '.join(labels)})"
            )
        return index

    def _token_id(self, target: int | str, role: str = "target") -> int:
        tokenizer = self.model.tokenizer
        if isinstance(target, int):
            vocabulary = getattr(self.model.model.config, "vocab_size", None) or len(tokenizer)
            if not 0 <= target < vocabulary:
                raise InputError(f"token id {target} out of range (vocabulary of {vocabulary})")
            return target
        ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            raise InputError(f"the {role} token {target!r} is {len(ids)} tokens ({pieces}); give exactly one token")
        return int(ids[0])

    # -- computing y -----------------------------------------------------------------------------

    def __call__(
        self,
        attention_mask: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One full forward pass: ``(y [batch], index [batch] or None, probability [batch] or None)``.

        ``index`` fixes the class or token per sample (perturbation methods pass the one resolved
        on the unaltered input); otherwise the user's fixed target or the argmax is used. With a
        contrast, y is the chosen logit minus the contrast's; the probability stays p(index).
        """
        import torch

        outputs = self.model.model(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **model_kwargs
        )
        if self.kind == "similarity":
            pooled = self._pool(outputs.last_hidden_state, attention_mask)
            return torch.nn.functional.cosine_similarity(pooled, self._reference_embedding(), dim=-1), None, None
        logits = outputs.logits
        if self.kind == "next_token":
            last = attention_mask.sum(dim=1) - 1  # [batch] last real position (right padding)
            logits = torch.log_softmax(logits[torch.arange(len(last)), last], dim=-1)  # [batch, vocab]
        if index is None:
            index = (
                torch.full((len(logits),), self.fixed_index, device=logits.device)
                if self.fixed_index is not None
                else logits.argmax(dim=-1)
            )
        chosen = logits.gather(1, index[:, None].to(logits.device))[:, 0]  # [batch]
        probability = (
            chosen.exp() if self.kind == "next_token" else torch.softmax(logits, dim=-1).gather(1, index[:, None])[:, 0]
        )
        if self.contrast_index is not None:
            chosen = chosen - logits[:, self.contrast_index]
        return chosen, index, probability

    def describe(self, y: float, index: int | None, probability: float | None) -> Target:
        if self.kind == "similarity":
            return Target("similarity", None, self.target_text, float(y))
        if index is None or probability is None:
            raise ValueError(f"a {self.kind} target needs its index and probability")
        contrast_label = None if self.contrast_index is None else self.label_of(self.contrast_index)
        label = self.label_of(index)
        return Target(self.kind, int(index), label, float(y), float(probability), self.contrast_index, contrast_label)

    def label_of(self, index: int) -> str:
        """A class's name or a token's text."""
        return self.labels[index] if self.kind == "class" else self.model.tokenizer.decode([index])

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, token, d_model]`` → ``[batch, d_model]``: the sentence encoder's mean pooling."""
        weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def _reference_embedding(self) -> torch.Tensor:
        """``[1, d_model]`` the pooled embedding of the target text."""
        import torch

        if self._reference is None:
            encoded = self.model.tokenizer(
                [self.target_text], truncation=True, max_length=self.model.max_length, return_tensors="pt"
            ).to(self.model.device)
            with torch.no_grad():
                hidden = self.model.model(**encoded).last_hidden_state
            self._reference = self._pool(hidden, encoded["attention_mask"])
        return self._reference
