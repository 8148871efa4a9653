"""Class probabilities of a classifier (or next-token probabilities of a causal LM) for many
token-id sequences at once.

`ClassifierScorer` pads sequences of any length into batches (sorted by length, so that little is
padding), runs one forward per batch without gradients and returns softmax probabilities
``[sequence, class]``. It takes an `AttentionModel` whose ``.model`` returns ``.logits
[batch, class]``; `check_classifier` says in one line when a model has no such head. For a causal
LM (``model.target_kind == "next_token"``) the classes are the vocabulary: the probabilities of the token
after each sequence's last one (`attnflow explain`'s per-input faithfulness of a next-token target).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.shared_prefix import ForwardBatch, forward_batches

# padded tokens per forward: on one CPU thread smollm2 takes 2.0 ms a token in batches of 2,048 and
# 2.5 ms in batches of 8,192 (activations that outgrow the cache); an accelerator wants larger ones
CPU_BATCH_TOKENS = 2048
DEVICE_BATCH_TOKENS = 8192


def check_classifier(model: ModelLike) -> list[str]:
    """The class names of a classifier `AttentionModel`; InputError when its module does not
    return ``logits [batch, class]`` (a bare encoder, a language model)."""
    import torch

    if model.tokenizer is None:
        raise InputError(f"model {model.name!r} has no tokenizer; the faithfulness benchmark needs text input")
    encoded = model.tokenizer(["a"], return_tensors="pt").to(model.device)
    with torch.inference_mode():
        output = model.hf_model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
    logits = getattr(output, "logits", None)
    if logits is None or logits.ndim != 2:
        raise InputError(
            f"model {model.name!r} has no classifier head (its output has no [batch, class] logits); "
            "evaluate a classifier such as minilm-sentiment or minilm-topics"
        )
    id2label = getattr(model.hf_model.config, "id2label", None) or {}
    if len(id2label) != logits.shape[1]:
        return [f"class {index}" for index in range(logits.shape[1])]
    return [str(id2label[index]) for index in range(logits.shape[1])]


class ClassifierScorer:
    """Softmax probabilities ``[sequence, class]`` of a classifier for token-id sequences.

    Args:
        model: an `AttentionModel` around a classifier (see `check_classifier`).
        max_batch_tokens: padded tokens per forward (``batch * longest``); bounds memory. Default:
            `CPU_BATCH_TOKENS` on a CPU, `DEVICE_BATCH_TOKENS` on an accelerator.
    """

    def __init__(self, model: ModelLike, max_batch_tokens: int | None = None) -> None:
        self.model = model
        on_cpu = str(model.device).startswith("cpu")
        self.max_batch_tokens = max_batch_tokens or (CPU_BATCH_TOKENS if on_cpu else DEVICE_BATCH_TOKENS)
        self.forwards = 0  # sequences scored so far (for benchmarks)
        self._memo: dict[tuple[tuple[int, ...], int], float] = {}  # (sequence, class) -> probability

    def probabilities(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """``[sequence, class]`` float64 probabilities, in the order of ``sequences``."""
        result = np.zeros((0, 0))
        for index, probabilities in self._batches(sequences):
            if result.size == 0:
                result = np.zeros((len(sequences), probabilities.shape[1]))
            result[index] = probabilities
        return result

    def chosen(
        self,
        sequences: Sequence[Sequence[int]],
        classes: Sequence[int],
        bases: Sequence[Sequence[int]] | None = None,
    ) -> np.ndarray:
        """``[sequence]`` p(``classes[i]`` | ``sequences[i]``). Each (sequence, class) pair is computed
        once per scorer and remembered (the benchmark's methods and the AOPC bounds share many
        perturbed inputs); only the chosen probabilities are kept, never whole rows. ``bases[i]``:
        the unedited input ``sequences[i]`` was made from (a causal LM then runs only the tokens
        after their shared start, `attnflow.shared_prefix`)."""
        keys = [(tuple(int(t) for t in sequence), int(c)) for sequence, c in zip(sequences, classes, strict=True)]
        base_of = {} if bases is None else dict(zip((key[0] for key in keys), bases, strict=True))
        missing = list(dict.fromkeys(key for key in keys if key not in self._memo))
        wanted: dict[tuple[int, ...], list[int]] = {}
        for sequence, c in missing:
            wanted.setdefault(sequence, []).append(c)
        unique = list(wanted)
        for index, probabilities in self._batches(unique, [base_of.get(sequence) for sequence in unique]):
            for row, i in enumerate(index):
                for c in wanted[unique[i]]:
                    self._memo[(unique[i], c)] = float(probabilities[row, c])
        return np.array([self._memo[key] for key in keys], dtype=np.float64)

    def _batches(
        self, sequences: Sequence[Sequence[int]], bases: Sequence[Sequence[int] | None] | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(sequence indices, probabilities [batch, class])`` per forward pass (``bases``: as in
        `chosen`, None where a sequence has none)."""
        import torch

        distinct: dict[tuple[int, ...], int] = {}  # each base once; () stands for none
        owners = [distinct.setdefault(tuple(b or ()), len(distinct)) for b in bases or [None] * len(sequences)]
        given = list(distinct) if any(distinct) else None
        for batch in forward_batches(self.model, sequences, self.max_batch_tokens, bases=given, owners=owners):
            with torch.inference_mode():
                logits = self._logits(batch)
            self.forwards += len(batch.rows)
            yield batch.rows, torch.softmax(logits.double(), dim=-1).cpu().numpy()

    def _logits(self, batch: ForwardBatch) -> Any:
        """``[batch, class]`` logits; causal LMs: next-token logits after each row's last real token,
        the output layer applied to those positions only (not to ``[batch, token, vocabulary]``)."""
        import torch

        network = self.model.hf_model
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, **batch.options}
        if self.model.target_kind != "next_token":
            return network(**inputs).logits
        hidden = network.base_model(**inputs).last_hidden_state  # [batch, token, d]
        last = hidden[torch.arange(len(hidden), device=hidden.device), batch.last]  # [batch, d]
        return network.get_output_embeddings()(last)  # [batch, vocabulary]


def target_values(scorer: Any, variants: Sequence[tuple[tuple[int, ...], Any]]) -> np.ndarray:
    """``[variant]`` p(the example's target) of each ``(ids, example)`` pair (an example: a
    benchmark ``Example`` with ``target`` and ``contrast``), minus p(its contrast) where it has one;
    every distinct (ids, class) pair is scored once, all in one ``scorer.chosen`` call (each
    variant's unedited input: its example's ``ids``)."""
    sequences = [ids for ids, _ in variants] + [ids for ids, e in variants if e.contrast is not None]
    classes = [e.target for _, e in variants] + [e.contrast for _, e in variants if e.contrast is not None]
    bases = [e.ids for _, e in variants] + [e.ids for _, e in variants if e.contrast is not None]
    chosen = scorer.chosen(sequences, classes, bases)
    values = chosen[: len(variants)].copy()
    contrasted = np.array([e.contrast is not None for _, e in variants], dtype=bool)
    values[contrasted] -= chosen[len(variants) :]
    return values
