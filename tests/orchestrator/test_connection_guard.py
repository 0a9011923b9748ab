"""The connection guard's books on a fake clock, with connections that are plain objects
holding what a real one would report: each deadline, which connection makes room at the cap,
and that one failing connection does not stop the sweep (tests/security/test_slow_connections.py
runs the same against a real server)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from orchestrator.connection_guard import ConnectionGuard, ConnectionLimits, Refusal

pytestmark = pytest.mark.unit

LIMITS = ConnectionLimits(
    header_timeout_s=10,
    body_min_rate=100,
    write_stall_timeout_s=60,
    max_per_address=5,
    max_total=6,
)


@dataclass(eq=False)
class Conn:
    """What the guard asks of a connection, as plain state the test sets."""

    received: int = 0
    server_holds: bool = False
    stream: bool = False
    unsent_bytes: int = 0
    gone: bool = False
    dropped: list[Refusal | None] = field(default_factory=list)
    broken: bool = False

    def held_by_server(self) -> bool:
        return self.server_holds

    def body_is_a_stream(self) -> bool:
        return self.stream

    def unsent(self) -> int:
        if self.broken:
            raise RuntimeError("a connection in a state nobody expected")
        return self.unsent_bytes

    def is_gone(self) -> bool:
        return self.gone

    def drop(self, refusal: Refusal | None) -> None:
        self.dropped.append(refusal)

    @property
    def closed(self) -> bool:
        return bool(self.dropped)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def guard(clock: Clock) -> AsyncIterator[ConnectionGuard]:
    # admit() starts the periodic sweep on the running loop; the tests sweep by hand and
    # never yield to the loop, so it never runs on its own.
    made = ConnectionGuard(LIMITS, clock)
    yield made
    if made._sweeper is not None:
        made._sweeper.cancel()


def admitted(guard: ConnectionGuard, host: str = "203.0.113.1") -> Conn:
    conn = Conn()
    assert guard.admit(conn, host) is None
    return conn


async def test_a_request_head_has_the_header_timeout(guard: ConnectionGuard, clock: Clock) -> None:
    conn = admitted(guard)
    guard.waiting(conn)
    clock.now += 9.9
    guard.sweep()
    assert not conn.closed
    clock.now += 0.1
    guard.sweep()
    assert conn.dropped and conn.dropped[0] is not None and conn.dropped[0].status == 408


async def test_the_next_head_waits_while_the_answer_before_is_still_being_taken(
    guard: ConnectionGuard, clock: Clock
) -> None:
    """A slow reader of a long answer is not cut by the next request's deadline; a client
    that stops taking it is, by the stalled write's."""
    reading, stopped = admitted(guard), admitted(guard)
    for conn in (reading, stopped):
        conn.unsent_bytes = 10_000_000
        guard.waiting(conn)
    for _ in range(100):  # 1,000 s, far past every deadline
        clock.now += 10
        reading.unsent_bytes -= 10_000
        guard.sweep()
    assert not reading.closed
    assert stopped.dropped == [None]  # cut, no answer: one was being sent
    reading.unsent_bytes = 0
    guard.sweep()
    clock.now += 10
    guard.sweep()
    assert reading.closed  # once sent, the next head has its own deadline


async def test_a_body_must_keep_the_minimum_rate(guard: ConnectionGuard, clock: Clock) -> None:
    slow, held, fast = admitted(guard), admitted(guard), admitted(guard)
    for conn in (slow, held, fast):
        guard.reading_body(conn)
    held.server_holds = True
    for _ in range(10):
        clock.now += 1
        fast.received += 100
        slow.received += 99
        guard.sweep()
    assert slow.dropped and slow.dropped[0] is not None and slow.dropped[0].status == 408
    assert not held.closed and not fast.closed


async def test_only_a_stream_the_protocol_vouches_for_may_pause(
    guard: ConnectionGuard, clock: Clock
) -> None:
    stream, other = admitted(guard), admitted(guard)
    stream.stream = True
    for conn in (stream, other):
        guard.reading_body(conn)
    clock.now += 119
    guard.sweep()
    assert other.closed and not stream.closed
    clock.now += 1
    guard.sweep()
    assert stream.closed  # 120 s without a byte


async def test_a_stalled_write_is_cut_and_progress_keeps_it(
    guard: ConnectionGuard, clock: Clock
) -> None:
    stalled, slow = admitted(guard), admitted(guard)
    guard.caller(stalled, proven=True)  # keyed or not: a client that stops reading is cut
    for conn in (stalled, slow):
        conn.unsent_bytes = 1_000_000
        guard.write_paused(conn)
    for _ in range(12):
        clock.now += 10
        slow.unsent_bytes -= 1
        guard.sweep()
    assert stalled.dropped == [None]
    assert not slow.closed
    guard.write_resumed(slow)  # writing again: no stall to time
    clock.now += 1000
    guard.sweep()
    assert not slow.closed


async def test_at_the_cap_the_heaviest_address_gives_up_its_longest_held_unproven(
    guard: ConnectionGuard, clock: Clock
) -> None:
    light = admitted(guard, "198.51.100.1")
    heavy = [admitted(guard, "198.51.100.2") for _ in range(3)]
    keyed = [admitted(guard, "198.51.100.3") for _ in range(2)]
    for conn in keyed:
        guard.busy(conn)
        guard.caller(conn, proven=True)
    guard.busy(heavy[0])  # busy or waiting: unproven either way
    newcomer = admitted(guard, "198.51.100.9")
    assert [c.closed for c in heavy] == [True, False, False]
    assert heavy[0].dropped[0] is not None and heavy[0].dropped[0].status == 503
    assert not light.closed and not newcomer.closed
    admitted(guard, "198.51.100.9")  # 198.51.100.2 holds 2 unproven, the most
    assert heavy[1].closed and not light.closed
    assert not any(c.closed for c in keyed)


async def test_an_idle_keyed_connection_may_make_room_a_served_one_never(
    guard: ConnectionGuard, clock: Clock
) -> None:
    keyed = [admitted(guard, f"198.51.100.{i}") for i in range(6)]
    for conn in keyed:
        guard.reading_body(conn)
        guard.caller(conn, proven=True)
    refusal = guard.admit(Conn(), "198.51.100.9")
    assert refusal is not None and refusal.status == 503
    assert "http_max_connections" in refusal.message
    guard.waiting(keyed[4])  # answered: now idle between requests
    assert guard.admit(Conn(), "198.51.100.9") is None
    assert keyed[4].closed and not any(c.closed for c in keyed[:4] + keyed[5:])


async def test_an_unproven_websocket_makes_room_a_proven_one_does_not(
    guard: ConnectionGuard, clock: Clock
) -> None:
    sockets = [admitted(guard, "198.51.100.1") for _ in range(3)] + [
        admitted(guard, "198.51.100.2") for _ in range(3)
    ]
    for conn in sockets:
        guard.detached(conn)
    for conn in sockets[:3]:
        guard.caller(conn, proven=True)
    admitted(guard, "198.51.100.9")
    assert [c.closed for c in sockets] == [False] * 3 + [True, False, False]


async def test_the_per_address_cap(guard: ConnectionGuard) -> None:
    for _ in range(5):
        admitted(guard, "2001:db8::1")
    refusal = guard.admit(Conn(), "2001:db8::2")  # the same /64
    assert refusal is not None and refusal.status == 429 and "2001:db8::/64" in refusal.message


async def test_a_released_connection_leaves_no_trace(guard: ConnectionGuard) -> None:
    conns = [admitted(guard) for _ in range(5)]
    for conn in conns:
        guard.release(conn)
    assert guard._entries == {} and guard._per_address == {}
    assert guard._evictable.victim() is None


async def test_a_gone_websocket_is_released(guard: ConnectionGuard) -> None:
    conn = admitted(guard)
    guard.detached(conn)
    conn.gone = True
    guard.sweep()
    assert admitted(guard) and conn not in guard._entries


async def test_one_failing_connection_does_not_stop_the_sweep(
    guard: ConnectionGuard, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    broken, late = admitted(guard), admitted(guard)
    broken.broken = True
    guard.waiting(broken)
    guard.waiting(late)
    clock.now += 10
    with caplog.at_level(logging.ERROR):
        guard.sweep()
    assert broken.dropped == [None] and broken not in guard._entries
    assert late.closed  # swept after the broken one
    assert "watching an HTTP connection failed" in caplog.text
