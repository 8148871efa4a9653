"""Checks on the texts given to `CaptureModel.capture_texts`: what is a text, and texts the model cannot read.

A text is a ``str``; ``None``, ``bytes`` and other objects are rejected with a message that says
what to do. Strings that hold lone surrogates (what Python makes of bytes that are not UTF-8 on
the command line, ``surrogateescape``) cannot reach a tokenizer and are rejected too, naming the
position. After tokenizing, a text whose content tokens are mostly the unknown token ([UNK]) is
worth a warning: the model sees placeholders, not the text (emoji, scripts outside its vocabulary).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

from attnflow.errors import InputError

log = logging.getLogger(__name__)

UNKNOWN_SHARE_WARNING = 0.5  # warn when more than this share of a text's content tokens is [UNK]
MAX_EXTRA_TOKENS = 4  # tokens that cover no byte of a text: [CLS]/<s>, [SEP]/</s>, a leading "▁", one more
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_texts(texts: Any) -> list[str]:
    """``texts`` (one string or a sequence of strings) as a list of non-empty, encodable strings."""
    if texts is None:
        raise InputError("no text given (None): pass a string or a list of strings")
    if isinstance(texts, (bytes, bytearray)):
        raise InputError(_bytes_message(texts))
    if isinstance(texts, str):
        texts = [texts]
    elif not isinstance(texts, Sequence):
        raise InputError(f"texts must be a string or a list of strings, got {type(texts).__name__}")
    checked = []
    for index, text in enumerate(texts):
        where = "" if len(texts) == 1 else f" (text {index})"
        if isinstance(text, (bytes, bytearray)):
            raise InputError(_bytes_message(text) + where)
        if not isinstance(text, str):
            raise InputError(f"a text must be a string, got {type(text).__name__}{where}")
        if not text.strip():
            raise InputError(f"the text to explain is empty{where}")
        check_encodable(text, where)
        checked.append(text)
    if not checked:
        raise InputError("no text given: the list of texts is empty")
    return checked


def check_encodable(text: str, where: str = "") -> None:
    """Reject lone surrogates: undecodable bytes smuggled in by ``surrogateescape`` (argv, os.fsdecode)."""
    match = _SURROGATE.search(text)
    if match is None:
        return
    code = ord(match.group())
    byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
    raise InputError(f"the text is not valid UTF-8: {byte} at character {match.start()}{where}; save it as UTF-8")


def unknown_share(token_ids: Sequence[int], special_mask: Sequence[bool], unknown_id: int | None) -> tuple[int, int]:
    """``(unknown, content)``: how many of a text's non-special tokens are the unknown token."""
    content = [token for token, special in zip(token_ids, special_mask, strict=True) if not special]
    if unknown_id is None:
        return 0, len(content)
    return sum(1 for token in content if token == unknown_id), len(content)


def truncation_notes(tokenizer: Any, texts: list[str], limit: int) -> list[list[str]]:
    """Per text, a note (also logged as a warning) when it is longer than ``limit`` tokens."""
    # One batched call, untruncated lengths; verbose=False: transformers' own "will result in
    # indexing errors" warning would repeat this one (attnflow truncates, so nothing breaks).
    return [
        [_warned(f"text of {len(ids)} tokens truncated to {limit} (the maximum; see --max-length)")]
        if len(ids) > limit
        else []
        for ids in tokenizer(texts, verbose=False)["input_ids"]
    ]


def unknown_notes(
    tokenizer: Any, model_name: str, texts: list[str], encoded: Any, lengths: list[int]
) -> list[list[str]]:
    """Per text, a note (also logged as a warning) when its content tokens are mostly the unknown
    token; ``encoded``: the padded batch (``input_ids``, ``special_tokens_mask`` ``[text, token]``),
    ``lengths``: each text's tokens without padding."""
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    notes: list[list[str]] = []
    for index, (text, n) in enumerate(zip(texts, lengths, strict=True)):
        unknown, content = unknown_share(
            encoded["input_ids"][index, :n].tolist(), encoded["special_tokens_mask"][index, :n].tolist(), unknown_id
        )
        if not (content and unknown / content > UNKNOWN_SHARE_WARNING):
            notes.append([])
            continue
        shown = text if len(text) <= 40 else text[:39] + "…"
        notes.append(
            [
                _warned(
                    f"text {shown!r}: {'all' if unknown == content else unknown} of its {content} tokens are the "
                    f"unknown token {tokenizer.unk_token} ({model_name} has no tokens for these characters), "
                    "so the explanation is about placeholders, not the text"
                )
            ]
        )
    return notes


def _warned(message: str) -> str:
    """Log ``message`` as a warning and return it (for a Trace's notes)."""
    log.warning("%s", message)
    return message


def _bytes_message(data: bytes | bytearray) -> str:
    return f"a text must be a string, got {type(data).__name__}: decode it first (e.g. data.decode('utf-8'))"


def check_row_fits(row: Any, texts: list[str], max_length: int | None) -> None:
    """Before the model loads: ``--row N`` must name a token of every text. A text of b UTF-8 bytes
    has at most b + `MAX_EXTRA_TOKENS` tokens (every token covers at least one byte, except the
    special ones and a leading word-boundary piece), and at most ``max_length`` (``--max-length``)."""
    if not isinstance(row, int):
        return
    for number, text in enumerate(texts, start=1):
        limit = len(text.encode("utf-8", "surrogateescape")) + MAX_EXTRA_TOKENS
        limit = limit if max_length is None else min(limit, max_length)
        if not -limit <= row < limit:
            which = "the text" if len(texts) == 1 else f"text {number}"
            raise InputError(f"{{row}} {row} is out of range: {which} has at most {limit} tokens", parameter="row")
