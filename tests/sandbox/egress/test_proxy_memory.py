"""What ended connections leave behind in the service's process."""

from __future__ import annotations

import asyncio

from tests.sandbox.egress.conftest import StartProxy, UpstreamServer, overrides, raw_exchange

CONNECTIONS = 300


def live_timers() -> int:
    """Timers still due on this loop. A cancelled one stays in the loop's heap until it comes due
    or the loop sweeps (past half cancelled): it holds nothing, and counting it made the count
    depend on when the loop last swept."""
    scheduled = asyncio.get_running_loop()._scheduled  # type: ignore[attr-defined]
    return sum(1 for timer in scheduled if not timer.cancelled())


async def test_ended_connections_leave_no_timers_behind(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    """An ended connection leaves nothing scheduled on the loop (no timer holding its transport
    for the idle time): else a sandbox opening connections in a loop grows the service's memory
    by its rate times that time, past the session's end."""
    running = await start_proxy(
        ["allowed.test:*"],
        resolve_overrides=overrides("allowed.test"),
        private_hosts=frozenset({"allowed.test"}),
    )
    before = live_timers()
    for _ in range(CONNECTIONS):
        answer = await raw_exchange(
            running.relay_port, b"GET http://refused.test/ HTTP/1.1\r\nHost: refused.test\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    await running.records(CONNECTIONS)
    await asyncio.sleep(0.5)
    left = live_timers() - before
    assert left < CONNECTIONS // 10, (
        f"{left} timers are still scheduled after {CONNECTIONS} connections ended"
    )


async def test_connections_over_the_cap_do_not_pile_up_in_the_service(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    """A sandbox may hold `max_connections_per_session` connections; one over it is answered
    503 and closed at once (a few linger a moment to read the request): code in the sandbox
    connects to /run/egress/proxy.sock itself, as fast as it likes, and must not grow what the
    service holds."""
    cap = 4
    running = await start_proxy("any", max_connections_per_session=cap)
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(cap):  # the sandbox's own, within the cap: a head that never ends
            _, writer = await asyncio.open_unix_connection(str(running.socket_path))
            writer.write(b"CONNECT a")
            held.append(writer)
        for _ in range(400):  # then many more, each kept open and silent
            _, writer = await asyncio.open_unix_connection(str(running.socket_path))
            held.append(writer)
        await asyncio.sleep(0.5)
        open_now = running.proxy.open_connections
        assert open_now <= 4 * cap, (
            f"the service holds {open_now} connections of one sandbox whose cap is {cap}"
        )
    finally:
        for writer in held:
            writer.transport.abort()
