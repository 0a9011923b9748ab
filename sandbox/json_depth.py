"""How deeply a JSON body nests, told without parsing it and without a loop per byte.

Recursive parsers (protobuf's JSON parser among them) can crash the whole process on input nested
tens of thousands of levels deep, so bodies are measured before any parser sees them. String
literals are dropped with one regular expression (their brackets are text), everything but
brackets with `bytes.translate`, then the innermost pairs are removed level by level with
`bytes.replace`: all C-speed passes, at most `limit` of them.
"""

from __future__ import annotations

import re

# A string literal; one that is never closed runs to the end, so a scan never backtracks.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
# `{` and `}` count like `[` and `]`; every other byte goes.
_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether `body`, read as JSON (or JSON lines), nests arrays and objects more than `limit`
    levels deep. Unbalanced input is judged by its openers: the parser refuses it anyway."""
    if b"[" not in body and b"{" not in body:
        return False
    structure = _STRING.sub(b"", body).translate(_SQUARE, _NOT_BRACKETS)
    for removed in range(limit + 1):
        # After `removed` passes, a run of openers still standing sits on at least `removed`
        # levels that were removed from inside it.
        if b"[" * (limit + 1 - removed) in structure:
            return True
        shorter = structure.replace(b"[]", b"")
        if len(shorter) == len(structure):
            return False
        structure = shorter
    return False
