"""Token strings as a reader wants to see them (figures, pages, the console); JSON keeps the raw ones.

Tokenizers mark word boundaries and bytes in their own ways: byte-level BPE (GPT-2, Llama 3,
SmolLM2) maps every byte to a printable character (``Ġ`` a space, ``Ċ`` a newline, ``Ã©`` the
two UTF-8 bytes of ``é``); SentencePiece writes ``▁`` for a space and ``<0x0A>`` for raw bytes;
WordPiece starts word-inner pieces with ``##``. `display_token` undoes each of these.
"""

from __future__ import annotations

import functools
import re

_SENTENCEPIECE_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SHOWN_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + shift)
            shift += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


def _from_byte_level(token: str) -> str | None:
    """The text of a byte-level BPE token, or None when ``token`` is not one."""
    alphabet = _byte_level_alphabet()
    if not token or any(character not in alphabet for character in token):
        return None
    raw = bytes(alphabet[character] for character in token)
    remapped = any(ord(character) >= 256 for character in token)  # Ġ, Ċ, ...: only byte-level BPE writes these
    if remapped:
        return raw.decode("utf-8", errors="replace")  # a piece of a split character shows as �
    try:
        return raw.decode("utf-8")  # "Ã©" -> "é"; a plain "é" (not valid alone) stays as it is
    except UnicodeDecodeError:
        return None


def display_token(token: str) -> str:
    """``Ġupon`` -> ``upon``, ``▁upon`` -> ``upon``, ``##ing`` -> ``ing``, ``Ċ`` -> ``\\n``,
    ``Ã©`` -> ``é``, ``<0x0A>`` -> ``\\n``; special tokens (``[CLS]``, ``<s>``) unchanged."""
    byte = _SENTENCEPIECE_BYTE.match(token)
    if byte:
        text = chr(int(byte.group(1), 16))
    elif token.startswith("##") and len(token) > 2:
        text = token[2:]
    else:
        text = token.replace("▁", " ")
        if not text.isascii():
            text = _from_byte_level(text) or text
    if text.strip():
        text = text.strip(" ")
    elif text:
        text = text.replace(" ", "␣")  # a token that is only spaces stays visible
    return "".join(_SHOWN_CONTROL.get(character, character) for character in text)
