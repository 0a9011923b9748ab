"""Long texts in a kernel message cut before the message is decoded, so that decoding never holds
more than a small multiple of what the output limit keeps.

A 100 MB exception message arrives twice (the error on iopub, the shell's reply), each with the
text twice (the value and the traceback's last line). Decoded whole, every copy becomes a string
as big as itself (four bytes a character once one is outside the BMP), only for the output
limit to keep a megabyte of it. Here the message's string literals are found at the byte level
(C-speed passes over 1 MiB chunks, a Python step only per string) and each one of more than a
few bytes is decoded on its own, a chunk at a time, into what is kept of it:

- near either end of the document (the first and the last `REGION_KEEPS * keep` characters of
  its longer strings): the string whole, or its first and last `keep` characters and the count
  between them (a `CutText`) when it is longer than twice that;
- in between: only its count of characters (an empty `CutText`). The consumers keep the head
  and the tail of each text and of each run of texts (a traceback's lines), and the last strings
  of a message are the ones read (an error's value, a traceback's last line), so what the middle
  loses is never kept anyway; counts stay exact.

The JSON parser sees the rest of the document, with a placeholder in place of each such string.
Decoding is as strict as decoding the document whole (`wire.decode_object`): invalid UTF-8, a
raw control character or a bad escape makes the message unusable either way. The structure
outside strings and the count of strings are bounded too: a message of too many values is
refused, never built.

The caller has checked the message's signature over its real bytes before any of this.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from array import array
from collections.abc import Iterator
from typing import Any

CHUNK_BYTES = 1 << 20
# Each end of a document keeps this many times `keep` characters of its longer strings whole (or
# cut to head and tail): enough for an error's value and its traceback's last line together.
# What a document decodes is at most about 2 * (REGION_KEEPS + 2) * keep characters of them.
REGION_KEEPS = 3
# Strings up to this long stay in the document (a placeholder is about as long): keys, names,
# statuses. Their count is bounded by MAX_STRINGS.
SHORT_LITERAL_BYTES = 64
# Bytes outside string literals (brackets, commas, numbers): each can become an object of tens
# of bytes, so a long run of them is refused rather than decoded.
MAX_STRUCTURE_BYTES = 2 << 20
# Each string costs a Python object or two (its placeholder, its count): no usable text message
# (a stream, an error, a reply, a status) has more. A traceback of more lines is refused.
MAX_STRINGS = 100_000

# As the whole document is decoded: UTF-8, encoded surrogates let through, anything else refused.
_UTF8 = codecs.getincrementaldecoder("utf-8")
# JSON allows none of these raw in a string (json.loads is strict by default).
_CONTROL = re.compile("[\x00-\x1f]")
# An escaped high surrogate: with the escaped low one after it, JSON makes one character.
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


class CutText(str):
    """A text whose middle was dropped before decoding: `head`, then `dropped` characters nobody
    decoded, then `tail`. As a plain string it reads as head, a marker and tail (which it holds
    once: `head` and `tail` are read out of it)."""

    dropped: int
    _head_chars: int
    _tail_chars: int

    def __new__(cls, head: str, tail: str, dropped: int) -> CutText:
        text = super().__new__(cls, f"{head}[... {dropped} characters dropped ...]{tail}")
        text.dropped, text._head_chars, text._tail_chars = dropped, len(head), len(tail)
        return text

    @property
    def head(self) -> str:
        return self[: self._head_chars]

    @property
    def tail(self) -> str:
        return self[len(self) - self._tail_chars :]


def shorten(data: bytes | memoryview, keep_chars: int) -> tuple[bytes | memoryview, dict[str, str]]:
    """`data` (a JSON document) with each string literal of over `SHORT_LITERAL_BYTES` bytes
    replaced by a placeholder string, and what each placeholder stands for (see the module's
    doc). Raises `ValueError` for a document that does not decode or has too many values."""
    spans = _long_literals(data, SHORT_LITERAL_BYTES)
    if not spans:
        return data, {}
    nonce = secrets.token_hex(16)  # the sandbox cannot write a placeholder of its own
    shortened = bytearray()
    cuts: dict[str, str] = {}
    done = 0
    for i, keep in enumerate(_kept_chars(spans, keep_chars)):
        start, end = spans[2 * i], spans[2 * i + 1]  # a literal's inside, quotes excluded
        placeholder = f"{nonce}:{i}"
        cuts[placeholder] = _decode_cut(data, start, end, keep)
        shortened += data[done:start]
        shortened += placeholder.encode()
        done = end
    shortened += data[done:]
    return memoryview(shortened), cuts


def restore(value: Any, cuts: dict[str, str]) -> None:
    """Put each cut text back where its placeholder was decoded, as a value or as a key."""
    if not cuts:
        return
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(key in cuts for key in node):
                items = list(node.items())
                node.clear()
                node.update((cuts.get(key, key), item) for key, item in items)
            pairs: Any = node.items()
        else:
            pairs = enumerate(node)
        for key, item in list(pairs):
            if isinstance(item, str):
                if item in cuts:
                    node[key] = cuts[item]
            elif isinstance(item, dict | list):
                stack.append(item)


def _kept_chars(spans: array[int], keep: int) -> Iterator[int]:
    """For each literal in `spans`: `keep` if it is among the first or the last literals whose
    kept parts (at most `2 * keep` characters each, no more than their bytes) add up to
    `REGION_KEEPS * keep`, else 0 (only its count is kept)."""
    region = REGION_KEEPS * keep
    costs = [min(spans[i + 1] - spans[i], 2 * keep) for i in range(0, len(spans), 2)]
    total = sum(costs)
    before = 0
    for cost in costs:
        yield keep if before < region or total - before - cost < region else 0
        before += cost


def _long_literals(data: bytes | memoryview, longer_than: int) -> array[int]:
    """The insides of the string literals of more than `longer_than` bytes: start, end, start...

    Escaped backslash pairs and escaped quotes are blanked per chunk with `bytes.replace` (a run
    of backslashes pairs up from its start, which is always an escape's start), so each quote
    left is a literal's edge. A chunk that ends in an escape's backslash carries it over."""
    spans = array("q")
    opened = -1  # where the open literal's inside starts; -1: outside any literal
    strings = in_strings = 0
    escaped_first = False
    for base in range(0, len(data), CHUNK_BYTES):
        chunk = bytes(data[base : base + CHUNK_BYTES])
        skip = 1 if escaped_first else 0
        flat = chunk[skip:].replace(b"\\\\", b"__").replace(b'\\"', b"__")
        escaped_first = flat.endswith(b"\\")
        at = flat.find(b'"')
        while at >= 0:
            position = base + skip + at
            if opened < 0:
                opened = position + 1
                strings += 1
                if strings > MAX_STRINGS:
                    raise ValueError(f"more than {MAX_STRINGS} strings")
            else:
                if position - opened > longer_than:
                    spans.extend((opened, position))
                in_strings += position - opened + 2
                opened = -1
            at = flat.find(b'"', at + 1)
    if opened >= 0:
        raise ValueError("a string is never closed")
    if len(data) - in_strings > MAX_STRUCTURE_BYTES:
        raise ValueError(f"more than {MAX_STRUCTURE_BYTES} bytes outside strings")
    return spans


def _decode_cut(data: bytes | memoryview, start: int, end: int, keep: int) -> str:
    """The literal `data[start:end]` (escaped, without its quotes) as its first and last `keep`
    characters and the count between them, decoded a chunk at a time; whole if it has no more.

    UTF-8 is decoded incrementally (a character cut by a chunk's end waits for the next chunk;
    invalid bytes raise), then escapes: an escape, or an escaped high surrogate, that a chunk's
    end may cut short waits for the next chunk too. Every chunk is consumed: no loop can stall.
    """
    if end - start <= CHUNK_BYTES:  # most are: one step, no decoder kept
        try:
            text = _unescape(str(data[start:end], "utf-8", "surrogatepass"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"a string literal that is not UTF-8 ({exc.reason})") from None
        if len(text) <= 2 * keep:
            return text
        return CutText(text[:keep], text[len(text) - keep :], len(text) - 2 * keep)
    decoder = _UTF8("surrogatepass")
    head: list[str] = []
    head_len = 0
    tail = ""
    dropped = 0
    pending = ""  # decoded, not yet unescaped: at most an escaped surrogate and a cut escape
    for at in range(start, end, CHUNK_BYTES):
        stop = min(at + CHUNK_BYTES, end)
        try:
            text = pending + decoder.decode(data[at:stop], stop == end)
        except UnicodeDecodeError as exc:
            raise ValueError(f"a string literal that is not UTF-8 ({exc.reason})") from None
        cut = len(text) if stop == end else _escape_boundary(text)
        pending = text[cut:]
        text = _unescape(text[:cut])
        if head_len < keep:
            taken = text[: keep - head_len]
            head.append(taken)
            head_len += len(taken)
            text = text[len(taken) :]
        tail += text
        if len(tail) > 2 * keep:  # trim in chunks: amortized linear
            dropped += len(tail) - keep
            tail = tail[len(tail) - keep :]
    if len(tail) > keep:
        dropped += len(tail) - keep
        tail = tail[len(tail) - keep :]
    if not dropped:
        return "".join(head) + tail
    return CutText("".join(head), tail, dropped)


def _escape_boundary(text: str) -> int:
    """Where `text` (decoded, still escaped, starting between two escapes) may be cut so that
    no escape is cut short and no escaped surrogate pair is split: its end, or a little before."""
    if "\\" not in text[-12:]:  # an escape is at most 6 characters, a pair of them 12
        return len(text)
    # Backslash runs pair up from their start: each backslash left starts an escape.
    flat = text.replace("\\\\", "__")
    cut = len(text)
    last = flat.rfind("\\", max(0, cut - 6))
    if last >= 0 and (last + 1 == cut or (text[last + 1] == "u" and cut - last < 6)):
        cut = last
    if cut >= 6 and flat[cut - 6] == "\\" and _HIGH_SURROGATE.fullmatch(text, cut - 6, cut):
        cut -= 6
    return cut


def _unescape(escaped: str) -> str:
    """The text of a JSON string literal's inside, as strict as json.loads."""
    if "\\" in escaped:
        text = json.loads(f'"{escaped}"')  # raises for a bad escape or a control character
        if not isinstance(text, str):
            raise ValueError("a string literal that does not decode")
        return text
    if _CONTROL.search(escaped):
        raise ValueError("a control character in a string literal")
    return escaped
