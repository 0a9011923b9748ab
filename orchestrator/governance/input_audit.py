"""What is typed into a terminal, or written to a background process's stdin, in the audit log
(`process.input`), bounded in size and in rate: input is gathered per process into records of
at most `record_bytes`, each written when a line ends, when it is full, or `FLUSH_S` after its
first byte; at most `records_per_minute` per session (a moving window, `limits`). Past that,
input is counted, not kept: the next record of the session says how many bytes (and records)
were dropped before it, or one record of its own does, a window after the first drop or when
the session ends. Memory: at most one record's bytes per process with input in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from orchestrator.governance import audit_kinds

if TYPE_CHECKING:
    from orchestrator.governance.audit import AuditLog

FLUSH_S = 1.0  # input not ended by a newline is written this long after its first byte
WINDOW_S = 60.0  # the rate's window: a drop is told at most this long after it


@dataclass
class _Gathered:
    """Input of one process not written yet."""

    owner: str
    terminal: bool
    data: bytearray = field(default_factory=bytearray)
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Dropped:
    """Input of one session the rate dropped since its last record."""

    owner: str
    bytes: int = 0
    records: int = 0
    timer: asyncio.TimerHandle | None = None


class InputAudit:
    def __init__(self, audit: AuditLog, *, record_bytes: int, records_per_minute: int) -> None:
        self._audit = audit
        self._record_bytes = record_bytes
        self._rate = RateLimitItemPerMinute(records_per_minute)
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._gathered: dict[tuple[str, int], _Gathered] = {}  # (session id, pid) -> input
        self._dropped: dict[str, _Dropped] = {}  # session id -> what the rate dropped

    def typed(self, session_id: str, owner: str, pid: int, data: bytes, *, terminal: bool) -> None:
        """Input written to process `pid` of the session (its terminal's, if `terminal`)."""
        key = (session_id, pid)
        rest = memoryview(data)
        while rest:
            gathered = self._gathered.get(key)
            if gathered is None:
                gathered = self._gathered[key] = _Gathered(owner, terminal)
                loop = asyncio.get_running_loop()
                gathered.timer = loop.call_later(FLUSH_S, self._flush, key)
            piece = bytes(rest[: self._record_bytes - len(gathered.data)])
            rest = rest[len(piece) :]
            gathered.data += piece
            full = len(gathered.data) >= self._record_bytes
            if (full or b"\n" in piece or b"\r" in piece) and not self._flush(key) and rest:
                # Over the rate: the rest of this write is dropped at once, not piece by piece.
                self._drop(session_id, owner, len(rest), -(-len(rest) // self._record_bytes))
                return

    def closed(self, session_id: str, pid: int) -> None:
        """The process's input ended (its stdin closed): what is gathered is written now."""
        self._flush((session_id, pid))

    def flush_session(self, session_id: str) -> None:
        """The session's processes are gone (it ended, or was paused): its input gathered is
        written, and what was dropped is told."""
        for key in [k for k in self._gathered if k[0] == session_id]:
            self._flush(key)
        self._tell_dropped(session_id)

    def forget_session(self, session_id: str) -> None:
        """The session ended: as `flush_session`, and its rate's window goes too."""
        self.flush_session(session_id)
        self._limiter.clear(self._rate, session_id)

    def close(self) -> None:
        """The service stops (before its audit log closes): nothing gathered is lost."""
        for session_id in {key[0] for key in self._gathered} | set(self._dropped):
            self.flush_session(session_id)

    def _flush(self, key: tuple[str, int]) -> bool:
        """Write the input gathered for `key`; False if the rate dropped it."""
        gathered = self._gathered.pop(key, None)
        if gathered is None:
            return True
        if gathered.timer is not None:
            gathered.timer.cancel()
        session_id, pid = key
        if not self._limiter.hit(self._rate, session_id):
            self._drop(session_id, gathered.owner, len(gathered.data), 1)
            return False
        details: dict[str, Any] = {
            "pid": pid,
            "terminal": gathered.terminal,
            "text": bytes(gathered.data).decode("utf-8", "backslashreplace"),
            "bytes": len(gathered.data),
        }
        dropped = self._dropped.pop(session_id, None)
        if dropped is not None:
            if dropped.timer is not None:
                dropped.timer.cancel()
            details |= {"dropped_bytes": dropped.bytes, "dropped_records": dropped.records}
        self._audit.record(
            audit_kinds.PROCESS_INPUT, owner=gathered.owner, session_id=session_id, details=details
        )
        return True

    def _drop(self, session_id: str, owner: str, size: int, records: int) -> None:
        dropped = self._dropped.get(session_id)
        if dropped is None:
            dropped = self._dropped[session_id] = _Dropped(owner)
            loop = asyncio.get_running_loop()
            dropped.timer = loop.call_later(WINDOW_S, self._tell_dropped, session_id)
        dropped.bytes += size
        dropped.records += records

    def _tell_dropped(self, session_id: str) -> None:
        """One record of what the rate dropped (at most one a window per session)."""
        dropped = self._dropped.pop(session_id, None)
        if dropped is None:
            return
        if dropped.timer is not None:
            dropped.timer.cancel()
        self._audit.record(
            audit_kinds.PROCESS_INPUT,
            owner=dropped.owner,
            session_id=session_id,
            status="dropped",
            details={"dropped_bytes": dropped.bytes, "dropped_records": dropped.records},
        )
