"""An exec's connection to the Docker engine, taken from docker-py: a plain socket of our own
(asyncio reads it), and the engine's reason when it refuses something."""

from __future__ import annotations

import contextlib
import io
import socket
from typing import Any

from code_interpreter_wire.errors import ProcessesUnsupported


def take_connection(hijacked: Any) -> tuple[socket.socket, bytes]:
    """A socket of our own for the exec's connection, and the bytes docker-py read past its
    HTTP headers. docker-py's response is closed: from here on the connection is ours alone."""
    raw = getattr(hijacked, "_sock", hijacked)
    if not isinstance(raw, socket.socket) or type(raw) is not socket.socket:
        with contextlib.suppress(Exception):
            hijacked.close()
        raise ProcessesUnsupported(
            "processes need a plain unix or tcp connection to the Docker engine (not TLS, ssh or "
            "a named pipe)"
        )
    connection = raw.dup()
    connection.setblocking(False)  # shared with `raw`: the peek below never blocks
    leftover = b""
    response = getattr(hijacked, "_response", None)
    buffered = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if isinstance(buffered, io.BufferedReader):
        with contextlib.suppress(OSError, ValueError):
            leftover = buffered.peek() or b""
    with contextlib.suppress(Exception):
        if response is not None:
            response.close()
    with contextlib.suppress(Exception):
        hijacked.close()
    with contextlib.suppress(Exception):
        raw.close()
    return connection, leftover


def engine_reason(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)
