"""The kernel process's own stdout and stderr, outside Jupyter: kept as a short tail in memory.

Whatever the code writes to the process's original descriptors (a crash on start-up, a child
that inherited them, a deliberate flood) goes to a pipe the host reads without pause, keeping the
last few KiB for start-up diagnostics and dropping the rest: nothing grows on disk or in memory,
and the kernel never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio

TAIL_BYTES = 16 << 10
_CHUNK = 1 << 16


class StdioTail:
    """Drains `stream` until its end, keeping only the last `limit` bytes."""

    def __init__(self, stream: asyncio.StreamReader, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self._tail = bytearray()
        self._task = asyncio.ensure_future(self._drain(stream))

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_CHUNK):
            self._tail += chunk[-self.limit :]
            if len(self._tail) > self.limit:
                del self._tail[: len(self._tail) - self.limit]

    async def settle(self, within_s: float = 1.0) -> None:
        """Wait (briefly) for what was written before the process ended to be read."""
        await asyncio.wait({self._task}, timeout=within_s)

    def stop(self) -> None:
        self._task.cancel()

    def text(self) -> str:
        return self._tail.decode(errors="replace")

    def __len__(self) -> int:
        return len(self._tail)
