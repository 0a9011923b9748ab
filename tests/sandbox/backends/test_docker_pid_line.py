"""The first line a Docker process's wrapper writes (its pid), read from the engine's framed
stream: what the command wrote next may come in the same frame (a reader behind a busy engine,
a fork bomb's complaints), and must not turn a started process into one that "did not start"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from code_interpreter_wire.errors import SandboxError
from sandbox.backends.docker_processes import _FRAME_HEADER, DockerProcess, _Source

pytestmark = pytest.mark.unit

STDERR = 2


def _process(stream: bytes) -> DockerProcess:
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    writer: Any = None
    return DockerProcess(
        None, "c", "1000", "e", _Source(reader, b""), writer, tty=False, stdin=False, marker="m"
    )


def _frame(data: bytes, kind: int = STDERR) -> bytes:
    return _FRAME_HEADER.pack(kind, len(data)) + data


async def test_the_pid_line_and_much_more_in_one_frame_is_a_started_process() -> None:
    complaints = b"bash: fork: retry: Resource temporarily unavailable\n" * 200  # ~10 KB
    process = _process(_frame(b"cir-pid 4242\n" + complaints))
    await process.read_pid()
    assert process.pid == 4242
    told = b"".join([data async for _, data in process.output()])
    assert told == complaints


async def test_a_first_line_that_never_ends_is_refused() -> None:
    process = _process(_frame(b"x" * 10_000))
    with pytest.raises(SandboxError, match="said no pid"):
        await process.read_pid()
