"""Bounds on the HTTP connections the service holds open, whatever a client does: a request must
arrive whole in bounded time, an answer must keep being taken, and no client address (nor all of
them together) holds more than its share of descriptors. uvicorn times out only a keep-alive
connection that sends nothing at all; it has no deadline for a request's head, no body rate, no
deadline for a client that stops reading and no connection caps, so one address's slow or
half-sent requests used to hold every descriptor the service had.

This module keeps the books and knows nothing of HTTP parsing: the protocol that serves a
connection (orchestrator/http_server.py) says when it waits on the client, reads a body, works
or cannot send, and whether the request's caller has proven a key (orchestrator/caller_mark.py);
one periodic sweep ends the connections past their time (never a timer for each)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)

# A stream of messages sent as they come (E2B's StreamInput: what a person types into a
# process) may pause for this long between bytes; E2B's SDK sends a keepalive every 50 s.
STREAMED_BODY_IDLE_S = 120.0
_SWEEP_EVERY_S = 1.0  # at most; a short header timeout sweeps more often
_LOG_EVERY_S = 10.0  # closed and refused connections are logged as counts, this often


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float  # for a whole request head; also a body's window for its rate
    body_min_rate: int  # bytes per second a body must average over each window
    write_stall_timeout_s: float  # an answer the client takes none of for this long: closed
    max_per_address: int
    max_total: int


@dataclass(frozen=True)
class Refusal:
    """Why a connection is not served, as its answer says it."""

    status: int
    kind: str
    message: str


class Watched(Protocol):
    """What the guard asks of a connection it watches."""

    received: int  # bytes received on it so far

    def held_by_server(self) -> bool:
        """The server, not the client, is why no body comes: it stopped reading (its buffer is
        full), or the client waits for `100 Continue`."""
        ...

    def body_is_a_stream(self) -> bool:
        """The request's body is a stream of messages sent as they come, not data sent at once,
        and its caller was authenticated as the client of such a stream."""
        ...

    def unsent(self) -> int:
        """Bytes of answers written that the client's socket has not taken yet."""
        ...

    def is_gone(self) -> bool: ...

    def drop(self, refusal: Refusal | None) -> None:
        """Close the connection, answering `refusal` if a request was part way in and nothing
        was answered to it (None: cut it off)."""
        ...


class Phase(Enum):
    WAITING = "waiting"  # for the client's next request head (or the rest of an answered one)
    BODY = "body"  # for the body of the request being served
    BUSY = "busy"  # the server's turn: no deadline of ours but the stalled write's
    DETACHED = "detached"  # upgraded (a WebSocket): counted, timed by its own protocol


@dataclass(slots=True)
class _Entry:
    address: str
    phase: Phase
    since: float  # when the phase, or the body's current window, began
    mark: int  # bytes received by then
    proven: bool = False  # the current request's caller showed a key that checked out
    evictable: bool = False


@dataclass(slots=True)
class _Stall:
    since: float  # when the client last took some of the answer (or the stall began)
    unsent: int  # what was left unsent then


def address_key(host: str) -> str:
    """The client a connection is counted against: its IPv4 address, or its IPv6 /64 (one
    host gets a whole /64, so counting single IPv6 addresses would count nothing)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a Unix socket's peer (''), counted as one client
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Evictable:
    """The connections that may be closed to make room, by address, and which address holds
    the most of them, in constant time per change (addresses bucketed by their count)."""

    def __init__(self) -> None:
        self._by_address: dict[str, OrderedDict[Watched, None]] = {}  # oldest first
        # OrderedDicts: a plain dict emptied from its front is slow to find its first key.
        self._addresses_holding: dict[int, OrderedDict[str, None]] = {}
        self._most = 0

    def add(self, conn: Watched, address: str) -> None:
        group = self._by_address.setdefault(address, OrderedDict())
        self._move(address, len(group), len(group) + 1)
        group[conn] = None

    def remove(self, conn: Watched, address: str) -> None:
        group = self._by_address[address]
        del group[conn]
        self._move(address, len(group) + 1, len(group))
        if not group:
            del self._by_address[address]

    def victim(self) -> Watched | None:
        """The longest-evictable connection of the address holding the most evictable ones."""
        if not self._most:
            return None
        address = next(iter(self._addresses_holding[self._most]))
        return next(iter(self._by_address[address]))

    def _move(self, address: str, before: int, after: int) -> None:
        if before:
            holding = self._addresses_holding[before]
            del holding[address]
            if not holding:
                del self._addresses_holding[before]
                if self._most == before and after < before:
                    self._most = after  # this address now holds `after`: that bucket is not empty
        if after:
            self._addresses_holding.setdefault(after, OrderedDict())[address] = None
            self._most = max(self._most, after)


class ConnectionGuard:
    """The service's connections by phase, with their deadlines and caps. Used on the event
    loop only (no lock needed)."""

    def __init__(
        self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._entries: dict[Watched, _Entry] = {}
        self._waiting: OrderedDict[Watched, None] = OrderedDict()  # the longest-waiting first
        self._bodies: dict[Watched, None] = {}
        self._detached: dict[Watched, None] = {}
        self._stalls: dict[Watched, _Stall] = {}
        self._evictable = _Evictable()
        self._per_address: Counter[str] = Counter()
        self._closed: Counter[str] = Counter()  # why, since the last log line
        self._logged_at = clock()
        self._sweeper: asyncio.TimerHandle | None = None

    def admit(self, conn: Watched, host: str) -> Refusal | None:
        """Count a new connection from `host`, or say why it is refused. At the total cap, a
        connection whose caller has not proven a key (whatever it is doing), or one idle
        between requests, makes room: the longest-held such one of the address that holds the
        most of them. So slow or keyless clients cannot keep a prompt one out, and a keyed
        request being served is never cut for a newcomer."""
        address = address_key(host)
        limits = self.limits
        if self._per_address[address] >= limits.max_per_address:
            self._count("refused_per_address")
            return Refusal(
                429,
                "TooManyConnections",
                f"this address ({address}) already has {limits.max_per_address} connections "
                "open to the service, its cap (http_max_connections_per_address): close idle "
                "connections or reuse them (keep-alive), then retry",
            )
        if len(self._entries) >= limits.max_total:
            victim = self._evictable.victim()
            if victim is None:
                self._count("refused_total")
                return Refusal(
                    503,
                    "TooManyConnections",
                    f"the service holds {limits.max_total} connections, its cap "
                    "(http_max_connections), all of them serving keyed requests: retry shortly",
                )
            self._check(victim, self._end, "evicted", _EVICTED)  # a failure: still gone
        entry = _Entry(address, Phase.BUSY, self._clock(), conn.received)
        self._entries[conn] = entry
        self._per_address[address] += 1
        self._update_evictable(conn, entry)
        self._keep_sweeping()
        return None

    def waiting(self, conn: Watched) -> None:
        """The connection waits on its client for a request: from now, the head has
        header_timeout_s to arrive whole (once the answer before it is sent)."""
        entry = self._entries.get(conn)
        if entry is not None and entry.phase is not Phase.WAITING:
            self._enter(conn, entry, Phase.WAITING)
            self._waiting[conn] = None

    def reading_body(self, conn: Watched) -> None:
        """A request is served whose body is still arriving: it must keep up the rate."""
        entry = self._entries.get(conn)
        if entry is not None and entry.phase is not Phase.BODY:
            self._enter(conn, entry, Phase.BODY)
            self._bodies[conn] = None

    def busy(self, conn: Watched) -> None:
        entry = self._entries.get(conn)
        if entry is not None and entry.phase is not Phase.BUSY:
            self._enter(conn, entry, Phase.BUSY)

    def detached(self, conn: Watched) -> None:
        """The connection now speaks another protocol; it stays counted until it closes."""
        entry = self._entries.get(conn)
        if entry is not None and entry.phase is not Phase.DETACHED:
            self._enter(conn, entry, Phase.DETACHED)
            self._detached[conn] = None

    def caller(self, conn: Watched, *, proven: bool) -> None:
        """A new request's caller is not proven yet (False), or has just proven a key (True)."""
        entry = self._entries.get(conn)
        if entry is not None and entry.proven is not proven:
            entry.proven = proven
            self._update_evictable(conn, entry)

    def write_paused(self, conn: Watched) -> None:
        """The connection's answers pile up unsent: the client must take some of them within
        write_stall_timeout_s, again and again, or the connection is cut."""
        if conn in self._entries and conn not in self._stalls:
            self._stalls[conn] = _Stall(self._clock(), conn.unsent())

    def write_resumed(self, conn: Watched) -> None:
        self._stalls.pop(conn, None)

    def release(self, conn: Watched) -> None:
        """The connection is closed (or closing): it no longer counts."""
        entry = self._entries.pop(conn, None)
        if entry is None:
            return
        self._leave(conn, entry)
        self._stalls.pop(conn, None)
        if entry.evictable:
            self._evictable.remove(conn, entry.address)
        self._per_address[entry.address] -= 1
        if self._per_address[entry.address] <= 0:
            del self._per_address[entry.address]

    def sweep(self) -> None:
        """End each connection past its deadline. One connection's failure is logged and
        ends that connection, never the sweep."""
        now = self._clock()
        for conn in list(self._waiting):
            entry = self._entries[conn]
            if now - entry.since < self.limits.header_timeout_s:
                break  # the rest came later
            self._check(conn, self._head_due, entry, now)
        for conn in list(self._bodies):
            self._check(conn, self._body_due, self._entries[conn], now)
        for conn, stall in list(self._stalls.items()):
            self._check(conn, self._write_due, stall, now)
        for conn in list(self._detached):
            self._check(conn, self._release_if_gone)
        self._log(now)

    def _check(self, conn: Watched, check: Callable[..., None], *args: object) -> None:
        try:
            check(conn, *args)
        except Exception:
            log.exception("watching an HTTP connection failed; it is closed")
            self.release(conn)
            with contextlib.suppress(Exception):
                conn.drop(None)

    def _head_due(self, conn: Watched, entry: _Entry, now: float) -> None:
        if conn.unsent():
            # The answer before is still going out: the next head's time starts once it is
            # sent; meanwhile the client must keep taking it.
            entry.since = now
            self._waiting.move_to_end(conn)
            self.write_paused(conn)
        else:
            self._end(conn, "header_timeout", _HEAD_TOO_SLOW)

    def _body_due(self, conn: Watched, entry: _Entry, now: float) -> None:
        if conn.held_by_server():
            entry.since, entry.mark = now, conn.received
        elif conn.body_is_a_stream():
            if conn.received > entry.mark:
                entry.since, entry.mark = now, conn.received
            elif now - entry.since >= STREAMED_BODY_IDLE_S:
                self._end(conn, "body_rate", _STREAM_IDLE)
        elif now - entry.since >= self.limits.header_timeout_s:
            window = now - entry.since
            if conn.received - entry.mark < self.limits.body_min_rate * window:
                self._end(conn, "body_rate", _BODY_TOO_SLOW)
            else:
                entry.since, entry.mark = now, conn.received

    def _write_due(self, conn: Watched, stall: _Stall, now: float) -> None:
        unsent = conn.unsent()
        if unsent == 0:
            del self._stalls[conn]
        elif unsent < stall.unsent:
            stall.since, stall.unsent = now, unsent
        elif now - stall.since >= self.limits.write_stall_timeout_s:
            self._end(conn, "write_stalled", None)
        else:
            stall.unsent = unsent  # more was written: progress counts from here

    def _release_if_gone(self, conn: Watched) -> None:
        if not conn.is_gone():
            return
        if conn.unsent():
            # Closing, but its answers wait on a client that takes none (a WebSocket's own
            # timeout closes, it does not abort): counted until the stalled write cuts it.
            self.write_paused(conn)
        else:
            self.release(conn)

    def _enter(self, conn: Watched, entry: _Entry, phase: Phase) -> None:
        self._leave(conn, entry)
        entry.phase, entry.since, entry.mark = phase, self._clock(), conn.received
        self._update_evictable(conn, entry)

    def _leave(self, conn: Watched, entry: _Entry) -> None:
        if entry.phase is Phase.WAITING:
            del self._waiting[conn]
        elif entry.phase is Phase.BODY:
            del self._bodies[conn]
        elif entry.phase is Phase.DETACHED:
            del self._detached[conn]

    def _update_evictable(self, conn: Watched, entry: _Entry) -> None:
        evictable = entry.phase is Phase.WAITING or not entry.proven
        if evictable and not entry.evictable:
            self._evictable.add(conn, entry.address)
        elif entry.evictable and not evictable:
            self._evictable.remove(conn, entry.address)
        entry.evictable = evictable

    def _end(self, conn: Watched, why: str, refusal: Refusal | None) -> None:
        self.release(conn)
        self._count(why)
        conn.drop(refusal)

    def _count(self, why: str) -> None:
        self._closed[why] += 1
        METRICS.http_connections_closed.labels(why).inc()

    def _log(self, now: float) -> None:
        if self._closed and now - self._logged_at >= _LOG_EVERY_S:
            told = ", ".join(f"{why}: {n}" for why, n in sorted(self._closed.items()))
            log.warning(
                "HTTP connections closed or refused in the last %.0f s (%s); %d open",
                now - self._logged_at,
                told,
                len(self._entries),
            )
            self._closed.clear()
            self._logged_at = now

    def _keep_sweeping(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self._interval(), self._tick)

    def _tick(self) -> None:
        try:
            self.sweep()
        except Exception:  # the books themselves are wrong: say so, keep sweeping
            log.exception("the HTTP connection sweep failed")
        finally:
            self._sweeper = asyncio.get_running_loop().call_later(self._interval(), self._tick)

    def _interval(self) -> float:
        return min(_SWEEP_EVERY_S, self.limits.header_timeout_s / 4)


_HEAD_TOO_SLOW = Refusal(
    408,
    "RequestTimeout",
    "the request did not arrive whole in time (http_header_timeout_s): send each request at once",
)
_BODY_TOO_SLOW = Refusal(
    408,
    "RequestTimeout",
    "the request body arrived slower than the service's minimum rate (http_body_min_rate)",
)
_STREAM_IDLE = Refusal(
    408,
    "RequestTimeout",
    f"the streamed request sent nothing for {STREAMED_BODY_IDLE_S:.0f} s: send a keepalive",
)
_EVICTED = Refusal(
    503,
    "TooManyConnections",
    "the service is at its connection cap (http_max_connections) and this connection had no "
    "keyed request being served, from the address holding the most such connections: retry",
)
