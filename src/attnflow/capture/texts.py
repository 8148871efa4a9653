"""Checks on the texts given to `AttentionModel.trace`: what is a text, and texts the model cannot read.

A text is a ``str``; ``None``, ``bytes`` and other objects are rejected with a message that says
what to do. Strings that hold lone surrogates (what Python makes of bytes that are not UTF-8 on
the command line, ``surrogateescape``) cannot reach a tokenizer and are rejected too, naming the
position. After tokenizing, a text whose content tokens are mostly the unknown token ([UNK]) is
worth a warning: the model sees placeholders, not the text (emoji, scripts outside its vocabulary).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from attnflow.errors import InputError

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
    raise InputError(
        f"the text is not valid UTF-8: {byte} at character {match.start()}{where}; "
        "save it as UTF-8 (or pass it with --file in UTF-8)"
    )


def unknown_share(token_ids: Sequence[int], special_mask: Sequence[bool], unknown_id: int | None) -> tuple[int, int]:
    """``(unknown, content)``: how many of a text's non-special tokens are the unknown token."""
    content = [token for token, special in zip(token_ids, special_mask, strict=True) if not special]
    if unknown_id is None:
        return 0, len(content)
    return sum(1 for token in content if token == unknown_id), len(content)


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
            raise InputError(f"--row {row} is out of range: {which} has at most {limit} tokens")
