"""Large JSON answers are encoded in a worker thread, in pieces, not on the event loop.

FastAPI serialises a route's return value on the loop, and one native call (pydantic's or
json's encoder) holds the interpreter's lock until it is done: a 40 MB execution held every other
caller's request for about a second, even from a thread. So a large answer is encoded in a worker
thread as many small encodings (long strings in slices, long lists in runs of items): between
two of them the loop gets the lock back. A small answer is encoded in place.
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from fastapi import Response
from pydantic import BaseModel

LARGE_BYTES = 256 * 1024  # an answer estimated past this is encoded in a worker thread
_PIECE = 256 * 1024  # characters of a string, or bytes of text, encoded in one native call
_RUN = 1024  # items of a list encoded in one native call, when they are small

_encode_small = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _size_past(value: object, budget: int) -> int:
    """What is left of `budget` after the text in `value` (keys included), stopping below
    zero. A walk with a stack of its own: data from a kernel may nest deep."""
    pending = [value]
    while pending and budget >= 0:
        item = pending.pop()
        if isinstance(item, str | bytes):
            budget -= len(item)
            continue
        if isinstance(item, BaseModel):
            item = item.__dict__
        if isinstance(item, dict):
            budget -= len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            budget -= len(item)
            pending.extend(item)
    return budget


def _encode_in_pieces(value: Any, out: list[bytes]) -> None:
    """Append the JSON of `value` (already JSON-compatible) to `out`, a small call at a time."""
    if _size_past(value, _PIECE) >= 0:
        out.append(_encode_small(value).encode())
    elif isinstance(value, str):
        out.append(b'"')
        for start in range(0, len(value), _PIECE):
            out.append(_encode_small(value[start : start + _PIECE])[1:-1].encode())
        out.append(b'"')
    elif isinstance(value, dict):
        out.append(b"{")
        for index, (key, item) in enumerate(value.items()):
            if index:
                out.append(b",")
            _encode_in_pieces(str(key), out)
            out.append(b":")
            _encode_in_pieces(item, out)
        out.append(b"}")
    elif isinstance(value, list | tuple):
        out.append(b"[")
        for start in range(0, len(value), _RUN):
            if start:
                out.append(b",")
            run = value[start : start + _RUN]
            if _size_past(run, _PIECE) >= 0:
                out.append(_encode_small(list(run))[1:-1].encode())
                continue
            for index, item in enumerate(run):
                if index:
                    out.append(b",")
                _encode_in_pieces(item, out)
        out.append(b"]")
    else:
        out.append(_encode_small(value).encode())


def encode_large(value: Any) -> bytes:
    pieces: list[bytes] = []
    _encode_in_pieces(value, pieces)
    return b"".join(pieces)


async def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """`model` as a JSON response, encoded off the loop when large."""
    if _size_past(model, LARGE_BYTES) >= 0:
        body = model.model_dump_json().encode()
    else:
        data = model.model_dump(mode="json")  # reuses the model's strings: cheap
        body = await anyio.to_thread.run_sync(encode_large, data)
    return Response(body, status_code=status_code, media_type="application/json")
