"""One session's log of egress connections: a bounded list of the latest, and running totals.

Bytes are counted while they flow (`count`), not only when a connection ends, because the
session's byte cap must hold across connections that are still open.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_METHOD_CHARS = 32  # of a request's method, as a record keeps it


@dataclass(frozen=True)
class EgressRecord:
    """One connection through the proxy, allowed or refused, written when it ends."""

    time: float  # when it was accepted, seconds since the epoch
    host: str  # normalized; "" when the request could not be read
    port: int  # 0 when the request could not be read
    method: str  # "CONNECT" or the HTTP method; "" when the request could not be read
    allowed: bool  # whether the proxy let it out (policy and address check passed)
    reason: str
    address: str | None  # the IP address actually dialled
    bytes_up: int  # sent to the destination
    bytes_down: int  # received from the destination
    duration_s: float
    # Each placeholder name seen in the request's headers and what became of it ("substituted",
    # "sent unchanged: host not bound", ...): names and outcomes only, never a value.
    credentials: tuple[tuple[str, str], ...] = ()

    def describe(self, session_id: str) -> str:
        """The record as one line of a log (the service's, or a node's when none took it)."""
        decision = "allowed" if self.allowed else "refused"
        secrets = ""
        if self.credentials:
            shown = "; ".join(f"{name}: {outcome}" for name, outcome in self.credentials)
            secrets = f" credentials=[{shown}]"
        return (
            f"egress session={session_id} {self.method or '-'} {self.host or '-'}:{self.port} "
            f"{decision} address={self.address or '-'} up={self.bytes_up} "
            f"down={self.bytes_down}{secrets}: {self.reason}"
        )


@dataclass
class EgressTotals:
    """Running counts of one session since its proxy started."""

    connections_allowed: int = 0
    connections_refused: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class EgressLedger:
    """The egress log of one session."""

    def __init__(
        self,
        session_id: str,
        *,
        keep: int = 1000,
        on_record: Callable[[EgressRecord], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.records: deque[EgressRecord] = deque(maxlen=keep)
        self.totals = EgressTotals()
        self._on_record = on_record

    @property
    def bytes_used(self) -> int:
        """Bytes up and down so far, open connections included: what the byte cap counts."""
        return self.totals.bytes_up + self.totals.bytes_down

    def count(self, *, up: int = 0, down: int = 0) -> None:
        """Bytes that have just gone through."""
        self.totals.bytes_up += up
        self.totals.bytes_down += down

    def add(self, record: EgressRecord) -> None:
        """A finished connection; its bytes were already counted with `count`."""
        self.records.append(record)
        if record.allowed:
            self.totals.connections_allowed += 1
        else:
            self.totals.connections_refused += 1
        if self._on_record is not None:
            try:
                self._on_record(record)
            except Exception:  # a metrics hook must never break the proxy
                log.exception("egress: the on_record hook of session %s failed", self.session_id)
