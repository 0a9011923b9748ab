"""The service's SQLite file (`state.db` under the state dir), shared by every store kept in it:
one connection, one lock, and one thread the async stores run their statements on.

WAL and `synchronous=NORMAL`: a committed row survives a crash of the service (not of the
machine's power), and each write costs well under a millisecond. Other processes (the `keys`
and `audit` commands) open the same file while the service runs: WAL and the busy timeout let
them take turns. The event loop never runs a statement itself: `run` hands each one to the
database's own thread, so a slow disk or a long retention delete holds up other statements,
never the loop.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

BUSY_TIMEOUT_S = 5.0  # how long a statement waits for another process's write to finish


class SqliteDatabase:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "state.db"
        self.connection = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S
        )
        self.path.chmod(0o600)
        # Every use of the connection holds it (the statements' thread, and a store's own
        # short synchronous reads where one has them).
        self.lock = threading.Lock()
        with self.lock:
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite")

    async def run(self, call: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
        """`call` on the database's thread (it takes `lock` itself), awaited from the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(call, *args, **kw))

    def executescript(self, script: str) -> None:
        """A store's schema, made when the store is (before the service serves)."""
        with self.lock:
            self.connection.executescript(script)

    def close(self) -> None:
        """After the statements handed over so far are done."""
        self._thread.shutdown(wait=True)
        with self.lock:
            self.connection.close()
