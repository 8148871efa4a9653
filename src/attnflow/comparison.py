"""`attnflow.compare`: one method's saliency for one text under two models ("what did fine-tuning change").

    comparison = attnflow.compare("minilm", "path/to/finetuned-minilm", "The movie was terrible.")
    comparison.spearman, comparison.overlap        # rank agreement, top-k overlap
    comparison.save("out/compare-models")               # model_comparison.json + model_comparison.html

Both models must split the text into the same tokens (same strings and ids): saliency vectors are
compared token by token, so two tokenizers that split the text differently are refused. Spearman ρ
and the top-k overlap (`attnflow.methods.agreement`) are taken over the content tokens (special
tokens left out); the difference is B − A for every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attnflow.errors import InputError
from attnflow.explanation import parse_row
from attnflow.methods.agreement import spearman, top_k_overlap
from attnflow.methods.saliency import Row
from attnflow.methods.summary import baseline_prefix, explanation_subject, summarize
from attnflow.model_like import ModelLike
from attnflow.staging import staged_output

# The views ("html", "fragment") live in attnflow.viz.compare and read Comparisons; the package root
# (attnflow/__init__.py) fills this table, so this module imports no view.
_VIEWS: dict[str, Callable[..., Any]] = {}

JSON_FILE = "model_comparison.json"
HTML_FILE = "model_comparison.html"


@dataclass
class Comparison:
    """Saliency of one text under models A and B, token by token.

    Attributes:
        tokens / special_mask ``[token]`` / offsets ``[token, 2]`` / text: the shared tokenization.
        model_a / model_b: the models' names.
        method / row: the method and saliency row used for both.
        scores_a / scores_b: ``[token]`` saliency scores; ``difference`` is B − A.
        spearman: Spearman ρ over the content tokens (NaN when undefined, e.g. constant scores).
        k / overlap: top-k overlap |top_k(A) ∩ top_k(B)| / k over the content tokens.
        vocabularies_match: whether the two tokenizers have the same vocabulary (the text's
            tokens match either way; a different vocabulary is reported, not refused).
        subject: what the scores explain, as the summary sentences say it ("the class
            negative", "the mean-pooled output ..."); ``subject_b``: model B's, where it differs
            (two classifiers explain each its own prediction), else "" (the same as A's).
    """

    tokens: list[str]
    special_mask: np.ndarray
    offsets: np.ndarray | None
    text: str
    model_a: str
    model_b: str
    method: str
    row: Row
    scores_a: np.ndarray
    scores_b: np.ndarray
    spearman: float
    k: int
    overlap: float
    vocabularies_match: bool = True
    subject: str = ""
    subject_b: str = ""

    @property
    def difference(self) -> np.ndarray:
        """``[token]`` B − A."""
        return self.scores_b - self.scores_a

    @property
    def content(self) -> np.ndarray:
        """Indices of the content (non-special) tokens."""
        return np.flatnonzero(~np.asarray(self.special_mask, dtype=bool))

    def summaries(self) -> tuple[str, str]:
        """The summary sentence of each model's saliency."""
        return tuple(  # type: ignore[return-value]
            baseline_prefix(self.method)
            + summarize(self.tokens, scores, subject, self.special_mask, self.text, self.offsets)
            for scores, subject in ((self.scores_a, self.subject), (self.scores_b, self.subject_b or self.subject))
        )

    def largest_changes(self, count: int = 5) -> list[tuple[int, str, float]]:
        """``(index, token, B − A)`` of the content tokens whose score changed most, largest first."""
        content = self.content
        order = content[np.argsort(-np.abs(self.difference[content]), kind="stable")][:count]
        return [(int(i), self.tokens[i], float(self.difference[i])) for i in order]

    def describe(self) -> list[str]:
        """The lines `attnflow compare` prints."""
        summary_a, summary_b = self.summaries()
        rho = "undefined (constant scores)" if np.isnan(self.spearman) else f"{self.spearman:.3f}"
        changes = [change for change in self.largest_changes() if change[2] != 0]
        lines = [
            f"A: {self.model_a}",
            f"B: {self.model_b}",
            f"same tokenization: {len(self.tokens)} tokens ({self.content.size} content tokens)"
            + ("" if self.vocabularies_match else "; the vocabularies differ elsewhere"),
            f"method {self.method}" + ("" if self.row is None else f", row {self.row}"),
            f"Spearman rank correlation (content tokens): {rho}",
            f"top-{self.k} overlap: {round(self.overlap * self.k)}/{self.k} ({100 * self.overlap:.0f} %)",
            f"A: {summary_a}",
            f"B: {summary_b}",
            "largest changes (B - A): "
            + (", ".join(f"{token} {change:+.4f}" for _, token, change in changes) or "none (identical scores)"),
        ]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_a": self.model_a,
            "model_b": self.model_b,
            "method": self.method,
            "row": self.row,
            "text": self.text,
            "tokens": list(self.tokens),
            "special_mask": np.asarray(self.special_mask, dtype=bool).tolist(),
            "scores_a": self.scores_a.tolist(),
            "scores_b": self.scores_b.tolist(),
            "difference": self.difference.tolist(),
            "spearman": None if np.isnan(self.spearman) else self.spearman,
            "k": self.k,
            "top_k_overlap": self.overlap,
            "vocabularies_match": self.vocabularies_match,
        }

    def to_html(self) -> str:
        return _VIEWS["html"](self)

    def _repr_html_(self) -> str:
        return _VIEWS["fragment"](self)

    def save(self, directory: str | Path, overwrite: bool = False) -> dict[str, Path]:
        """Write ``model_comparison.json`` and ``model_comparison.html`` into ``directory`` (created).
        An existing comparison is replaced only with ``overwrite=True`` (FileExistsError otherwise)."""
        directory = Path(directory)
        with staged_output(directory, is_comparison_file, overwrite) as scratch:
            (scratch / JSON_FILE).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")
            (scratch / HTML_FILE).write_text(self.to_html(), encoding="utf-8")
        return {"json": directory / JSON_FILE, "html": directory / HTML_FILE}


def is_comparison_file(name: str) -> bool:
    """Whether a folder entry is one of `Comparison.save`'s files."""
    return name in (JSON_FILE, HTML_FILE)


def check_same_tokenization(model_a: Any, model_b: Any, text: str, max_length: int | None = None) -> bool:
    """Raise InputError (one line) unless both tokenizers split ``text`` into the same tokens and
    ids; return whether their whole vocabularies match too."""
    for model in (model_a, model_b):
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"{model.name} has no tokenizer: compare takes two text models")
    names, tokenizers = (model_a.name, model_b.name), (model_a.tokenizer, model_b.tokenizer)
    return check_same_tokens(names, tokenizers, text, max_length)


def check_same_tokens(names: tuple[str, str], tokenizers: tuple[Any, Any], text: str, max_length: int | None) -> bool:
    """`check_same_tokenization` on two tokenizers alone (``names``: their models', for the message),
    so that the check can run before any weights load."""
    encoded = []
    for tokenizer in tokenizers:
        ids = tokenizer(text, truncation=max_length is not None, max_length=max_length)["input_ids"]
        encoded.append((list(ids), tokenizer.convert_ids_to_tokens(list(ids))))
    (ids_a, tokens_a), (ids_b, tokens_b) = encoded
    if ids_a != ids_b or tokens_a != tokens_b:
        position = next(
            (
                i
                for i, pair in enumerate(zip(tokens_a, tokens_b, strict=False))
                if pair[0] != pair[1] or ids_a[i] != ids_b[i]
            ),
            min(len(ids_a), len(ids_b)),
        )
        first_a = tokens_a[position] if position < len(tokens_a) else "(end)"
        first_b = tokens_b[position] if position < len(tokens_b) else "(end)"
        raise InputError(
            f"{names[0]} and {names[1]} tokenize the text differently ({len(ids_a)} vs {len(ids_b)} tokens; "
            f"first difference at token {position}: {first_a!r} vs {first_b!r}); compare needs the same tokenizer"
        )
    return tokenizers[0].get_vocab() == tokenizers[1].get_vocab()


def compare(
    model_a: Any,
    model_b: Any,
    text: str,
    *,
    method: str = "rollout",
    row: Row | None = None,
    k: int = 5,
    max_length: int | None = None,
    target: Any = None,
    target_text: str | None = None,
) -> Comparison:
    """Saliency of ``text`` under two models with the same tokenizer, and their agreement.

    Args:
        model_a / model_b: loaded models or names to load.
        method: a registered method; each model runs it through its front door, ``model.explain``.
        row: saliency row for both (None: model A's default; ignored by attribution-only methods).
        k: size of the top-k overlap (at most the number of content tokens).
        target: what target-dependent methods explain, the same for both models (a
            `attnflow.targets.Target`, or a class or token for short; ``target_text``: the deprecated
            spelling of ``Target(text=...)``).
    """
    from attnflow.targets import legacy_target

    wanted = legacy_target(target, target_text, None, "compare")
    if not text or not text.strip():
        raise InputError("the text to compare is empty")
    model_a, model_b = (_loaded(model) for model in (model_a, model_b))
    vocabularies_match = check_same_tokenization(model_a, model_b, text, max_length)
    row = parse_row(row) if row is not None else model_a.default_row  # one row for both
    explanation_a, explanation_b = (
        model.explain(text, method=method, row=row, target=wanted, max_length=max_length)
        for model in (model_a, model_b)
    )
    special = np.asarray(explanation_a.special_mask, dtype=bool)
    content = np.flatnonzero(~special)
    if content.size < 1:
        raise InputError("the text has no content tokens to compare")
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= content.size:
        raise InputError(
            f"{{k}} must be an integer in [1, {content.size}] (the number of content tokens), got {k}", parameter="k"
        )
    scores_a, scores_b = explanation_a.scores, explanation_b.scores
    return Comparison(
        tokens=list(explanation_a.tokens),
        special_mask=special,
        offsets=explanation_a.offsets,
        text=explanation_a.text,
        model_a=model_a.name,
        model_b=model_b.name,
        method=method,
        row=explanation_a.row,
        scores_a=scores_a,
        scores_b=scores_b,
        spearman=spearman(scores_a[content], scores_b[content]),
        k=int(k),
        overlap=top_k_overlap(scores_a[content], scores_b[content], int(k)),
        vocabularies_match=vocabularies_match,
        subject=explanation_subject(explanation_a),
        subject_b=explanation_subject(explanation_b),
    )


def _loaded(model: ModelLike) -> Any:
    if isinstance(model, str):
        from attnflow.model import load

        return load(model)
    return model
