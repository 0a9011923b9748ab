"""Host tools the tests register: in-process, and by import path in a served orchestrator
(`tests.orchestrator.host_tools.tools_for_tests:TOOLS`)."""

from __future__ import annotations

import asyncio
from typing import Any


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def slow(seconds: float) -> float:
    """Sleep on the host, then answer with the seconds slept.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return seconds


def blocking_slow(seconds: float) -> float:
    """The same as slow, but a sync function (it runs in a thread)."""
    import time

    time.sleep(seconds)
    return seconds


def fail(message: str) -> str:
    """Always raises, with this message."""
    raise RuntimeError(message)


def big(size: int) -> str:
    """A string of `size` characters."""
    return "x" * size


def echo(value: Any) -> Any:
    """Answer with what was sent."""
    return value


async def secret() -> str:
    """Registered, but no test session is allowed it."""
    return "the host's secret"


TOOLS = [add, slow, blocking_slow, fail, big, echo, secret]
