"""Windowing: a corpus becomes a deterministic stream of fixed-length token windows.

The rule: documents are tokenized without special tokens and packed end to end in
corpus order into one stream of wordpieces. Window ``k`` takes the ``content_len`` wordpieces at
stream positions ``[k * stride, k * stride + content_len)`` and wraps them in the model's own
special tokens (``[CLS] … [SEP]`` for BERT, ``<s> … </s>`` for MPNet), so every window has exactly
``seq_len`` tokens and no padding; ``content_len = seq_len - (number of special tokens)`` (126 for
BERT at 128). The default stride is ``content_len`` (disjoint windows); a smaller stride overlaps
them. A trailing partial window is dropped.

Sentence ids come from a real sentence splitter (pysbd) run on each document's raw text; each
token takes the sentence in which its first character lies (through the tokenizer's offsets).
Inside a window the sentences are numbered 0, 1, 2, … in order, special tokens get -1, and a
sentence cut by a window boundary is simply a sentence of each window. Sentences of different
documents are always different sentences.

The stream is a generator: it holds one document chunk and one window's worth of wordpieces, never
all windows. ``start=k`` skips the first ``k`` windows cheaply (no sentence splitting, no arrays)
and yields exactly the windows an uninterrupted stream would yield from ``k`` on: this is how
``--resume`` continues.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from attnflow.errors import InputError

log = logging.getLogger(__name__)

PUNCTUATION = (".", ",")


@dataclass(frozen=True)
class Window:
    """One window: ``index`` in the stream, ``token_ids`` and ``sentence_ids``, both ``[seq_len]`` int64."""

    index: int
    token_ids: np.ndarray
    sentence_ids: np.ndarray


@dataclass(frozen=True)
class WindowBatch:
    """Consecutive windows stacked: ``token_ids`` and ``sentence_ids`` are ``[batch, seq_len]`` int64."""

    first: int
    token_ids: np.ndarray
    sentence_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (``[101], [102]`` for BERT)."""
    probe = "window probe"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    raise InputError("cannot tell which special tokens this tokenizer adds around a text")


def marker_token_ids(tokenizer) -> tuple[dict[str, int], dict[str, int]]:
    """(special tokens, punctuation) as ``{token: id}``, for the attention statistics.

    Special tokens are those `special_tokens` finds (e.g. ``{"[CLS]": 101, "[SEP]": 102}``);
    punctuation is "." and "," when each is a single wordpiece.
    """
    prefix, suffix = special_tokens(tokenizer)
    special = {}
    for token_id in prefix + suffix:
        special[tokenizer.convert_ids_to_tokens(int(token_id))] = int(token_id)
    punctuation = {}
    for mark in PUNCTUATION:
        ids = tokenizer(mark, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            punctuation[mark] = int(ids[0])
    return special, punctuation


class SentenceSplitter:
    """pysbd on raw text → the character offset where each sentence starts."""

    def __init__(self, language: str = "en") -> None:
        import pysbd

        self._segmenter = pysbd.Segmenter(language=language, clean=False)

    def starts(self, text: str) -> np.ndarray:
        """``[n_sentences]`` increasing start offsets (the first is 0)."""
        try:
            sentences = self._segmenter.segment(text)
        except Exception as error:  # pysbd has crashed on odd input; the document stays one sentence
            log.debug("pysbd failed (%s); keeping the document as one sentence", error)
            return np.zeros(1, dtype=np.int64)
        starts = [0]
        position = 0
        for sentence in sentences:
            found = text.find(sentence, position)
            if found < 0:
                stripped = sentence.strip()
                found = text.find(stripped, position) if stripped else -1
                sentence = stripped
            if found < 0:
                continue  # not locatable: merge it into the previous sentence
            if found > starts[-1]:
                starts.append(found)
            position = found + len(sentence)
        return np.asarray(starts, dtype=np.int64)


class WindowStream:
    """Iterable over `Window`s of exactly ``seq_len`` tokens (see the module doc).

    Args:
        documents: document texts in a fixed order (a `Corpus`, a list…); iterated once per pass.
        tokenizer: a Hugging Face fast tokenizer (offsets are needed).
        seq_len: tokens per window, special tokens included.
        stride: wordpieces between window starts; default ``content_len`` (no overlap).
        samples: stop after this many windows (None: as many as the corpus gives).
        start: skip the first ``start`` windows (resume).
        doc_chunk: documents tokenized per tokenizer call.

    After a pass, ``windows`` is the number of windows the stream reached (skipped ones included),
    ``documents_read`` / ``tokens_read`` what it consumed, and ``exhausted`` whether the corpus ran
    out before ``samples``.
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer,
        *,
        seq_len: int = 128,
        stride: int | None = None,
        samples: int | None = None,
        start: int = 0,
        doc_chunk: int = 64,
        language: str = "en",
    ) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.prefix, self.suffix = special_tokens(tokenizer)
        self.seq_len = int(seq_len)
        self.content_len = self.seq_len - len(self.prefix) - len(self.suffix)
        if self.content_len < 1:
            raise InputError(
                f"{{seq_len}} {seq_len} leaves no room for text next to the special tokens", parameter="seq_len"
            )
        self.stride = self.content_len if stride is None else int(stride)
        if self.stride < 1:
            raise InputError(f"{{stride}} must be at least 1, not {stride}", parameter="stride")
        if samples is not None and samples < 1:
            raise InputError(f"{{samples}} must be at least 1, not {samples}", parameter="samples")
        self.samples = samples
        self.start = int(start)
        self.doc_chunk = doc_chunk
        self.language = language
        self.windows = 0
        self.documents_read = 0
        self.tokens_read = 0
        self.exhausted = False

    def __iter__(self) -> Iterator[Window]:
        splitter = SentenceSplitter(self.language)
        prefix = np.asarray(self.prefix, dtype=np.int64)
        suffix = np.asarray(self.suffix, dtype=np.int64)
        special_prefix = np.full(len(prefix), -1, dtype=np.int64)
        special_suffix = np.full(len(suffix), -1, dtype=np.int64)
        first_needed = self.start * self.stride  # stream positions before this are never emitted
        self.windows = self.documents_read = self.tokens_read = 0
        self.exhausted = False
        # The buffer holds stream positions [buffer_start, buffer_start + len(ids)).
        ids = np.zeros(0, dtype=np.int64)
        sentences = np.zeros(0, dtype=np.int64)  # global sentence numbers, increasing along the stream
        buffer_start = 0
        next_sentence = 0
        for chunk in _chunks(self.documents, self.doc_chunk):
            encoded = self.tokenizer(
                chunk,
                add_special_tokens=False,
                return_offsets_mapping=True,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )
            for text, doc_ids, offsets in zip(chunk, encoded["input_ids"], encoded["offset_mapping"], strict=True):
                self.documents_read += 1
                if not doc_ids:
                    continue
                doc_ids = np.asarray(doc_ids, dtype=np.int64)
                doc_end = self.tokens_read + len(doc_ids)
                if doc_end > first_needed:
                    token_starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
                    local = np.searchsorted(splitter.starts(text), token_starts, side="right") - 1
                    doc_sentences = next_sentence + np.maximum(local, 0)
                    next_sentence = int(doc_sentences[-1]) + 1
                else:  # skipped by `start`: never emitted, no need to split sentences
                    doc_sentences = np.full(len(doc_ids), next_sentence, dtype=np.int64)
                    next_sentence += 1
                self.tokens_read = doc_end
                ids = np.concatenate([ids, doc_ids])
                sentences = np.concatenate([sentences, doc_sentences])
                while self.samples is None or self.windows < self.samples:
                    begin = self.windows * self.stride - buffer_start
                    if begin + self.content_len > len(ids):
                        break
                    if self.windows >= self.start:
                        piece = sentences[begin : begin + self.content_len]
                        numbered = np.concatenate([[0], np.cumsum(piece[1:] != piece[:-1])])
                        yield Window(
                            index=self.windows,
                            token_ids=np.concatenate([prefix, ids[begin : begin + self.content_len], suffix]),
                            sentence_ids=np.concatenate([special_prefix, numbered, special_suffix]),
                        )
                    self.windows += 1
                if self.samples is not None and self.windows >= self.samples:
                    return
                drop = max(0, min(self.windows * self.stride - buffer_start, len(ids)))
                ids, sentences = ids[drop:], sentences[drop:]
                buffer_start += drop
        self.exhausted = True
        if self.tokens_read < self.content_len:
            raise InputError(
                f"the corpus has {self.tokens_read} wordpieces, fewer than one window needs "
                f"({self.content_len} for {{seq_len}} {self.seq_len}); add text or lower {{seq_len}}",
                parameter="seq_len",
            )

    def shortfall(self) -> str | None:
        """After a pass: a message when the corpus gave fewer windows than ``samples``, else None."""
        if not self.exhausted or self.samples is None or self.windows >= self.samples:
            return None
        message = (
            f"the corpus gave {self.windows} windows of {self.seq_len} tokens "
            f"({self.tokens_read} wordpieces at stride {self.stride}), fewer than --samples {self.samples}"
        )
        if self.samples > 1 and self.tokens_read > self.content_len:
            stride = (self.tokens_read - self.content_len) // (self.samples - 1)
            if 1 <= stride < self.stride:
                return message + f"; overlap the windows with --stride {stride} to get {self.samples}"
        return message + "; add text to reach --samples"


def batched(windows: Iterable[Window], batch_size: int) -> Iterator[WindowBatch]:
    """Group consecutive windows into `WindowBatch`es of ``batch_size`` (the last may be smaller)."""
    if batch_size < 1:
        raise InputError(f"{{batch_size}} must be at least 1, not {batch_size}", parameter="batch_size")
    pending: list[Window] = []
    for window in windows:
        pending.append(window)
        if len(pending) == batch_size:
            yield _stack(pending)
            pending = []
    if pending:
        yield _stack(pending)


def _stack(windows: list[Window]) -> WindowBatch:
    return WindowBatch(
        first=windows[0].index,
        token_ids=np.stack([w.token_ids for w in windows]),
        sentence_ids=np.stack([w.sentence_ids for w in windows]),
    )


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
