"""The loops that take egress records of sessions whose proxy runs elsewhere
(orchestrator/cluster/egress_relay.py), over a real outbox (sandbox/egress/outbox.py) standing
for a node's: each record handed on once, one loop per session and sandbox, a closed proxy
ends its loop, a failure is retried."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import pytest

from code_interpreter_wire.errors import BackendUnavailable
from code_interpreter_wire.network_policy import NetworkPolicy
from orchestrator.cluster import egress_relay
from orchestrator.cluster.egress_relay import EgressRelays
from orchestrator.cluster.shared import RelayedEgress
from sandbox.egress import EgressRecord, EgressSettings
from sandbox.egress.outbox import EgressBatch, EgressOutbox, EgressReport
from sandbox.egress.slots import SharedCaps

pytestmark = pytest.mark.unit


class OutboxSandbox:
    """What a relayed sandbox gives the service, answered from an outbox in this process;
    `failing` polls fail first, as while its node is out of reach."""

    def __init__(self, failing: int = 0, *, of: OutboxSandbox | None = None) -> None:
        """`of`: another handle on that sandbox (as a second attach of it makes)."""
        self.id: str = of.id if of is not None else secrets.token_hex(8)
        self.outbox: EgressOutbox = of.outbox if of is not None else EgressOutbox()
        self.failing = failing
        self.polls = 0

    async def open_egress(
        self, ceiling: NetworkPolicy, settings: EgressSettings, caps: SharedCaps
    ) -> bool:
        return True

    async def egress_records(self, max_wait_s: float) -> EgressBatch:
        self.polls += 1
        if self.failing:
            self.failing -= 1
            raise BackendUnavailable("the cluster is out of reach")
        return await self.outbox.take(max_wait_s)

    async def egress_report(self, most: int) -> EgressReport | None:
        return None


def _record(host: str) -> EgressRecord:
    return EgressRecord(0.0, host, 443, "CONNECT", True, "ok", None, 0, 0, 0.0)


async def _until(check: Callable[[], bool]) -> None:
    """Until `check` holds; the test fails after 10 s (no timed assertion: a bound)."""
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    pytest.fail("still waiting after 10 s")


async def test_each_record_is_handed_on_once_and_a_closed_proxy_ends_the_loop() -> None:
    sandbox = OutboxSandbox()
    assert isinstance(sandbox, RelayedEgress)
    relays, seen = EgressRelays(), list[str]()
    await relays.start("s1", sandbox, lambda r: seen.append(r.host))
    await relays.start("s1", sandbox, lambda r: seen.append("again: " + r.host))  # no second
    for host in ("a.test", "b.test"):
        sandbox.outbox.add(_record(host))
    await _until(lambda: len(seen) == 2)
    assert seen == ["a.test", "b.test"]
    sandbox.outbox.close()
    await _until(lambda: "s1" not in relays)  # SandboxClosed: the loop ended by itself
    await relays.close()


async def test_another_sandbox_of_the_session_replaces_the_loop() -> None:
    old, new = OutboxSandbox(), OutboxSandbox()
    relays, seen = EgressRelays(), list[str]()
    await relays.start("s1", old, lambda r: seen.append("old"))
    await relays.start("s1", new, lambda r: seen.append("new"))  # resumed elsewhere
    old.outbox.add(_record("a.test"))
    new.outbox.add(_record("b.test"))
    await _until(lambda: seen == ["new"])
    assert old.outbox.leftovers()[0] != []  # nobody polls the old one any more
    # What a replica asks before serving a session it attached (channels.py): served on the
    # new sandbox, not on the old one any more (a stale copy dropped must not count).
    assert relays.serves("s1", new) and not relays.serves("s1", old)
    # ... and what a pause of the old one asks before closing the session's channels here.
    assert relays.serves_another("s1", old) and not relays.serves_another("s1", new)
    await relays.stop("s1")
    assert "s1" not in relays and not relays.serves("s1", new)


async def test_two_handles_on_one_sandbox_are_one_sandbox() -> None:
    """A replica may hold two handles on one sandbox (attached twice): the loop of the first
    serves the second too, and a pause through either is a pause of the sandbox it serves."""
    first = OutboxSandbox()
    second = OutboxSandbox(of=first)
    relays, seen = EgressRelays(), list[str]()
    await relays.start("s1", first, lambda r: seen.append("first"))
    await relays.start("s1", second, lambda r: seen.append("second"))  # not a new loop
    first.outbox.add(_record("a.test"))
    await _until(lambda: seen == ["first"])
    assert relays.serves("s1", second) and not relays.serves_another("s1", second)
    assert second.polls == 0
    await relays.close()


async def test_a_failed_poll_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress_relay, "RETRY_FIRST_S", 0.01)
    sandbox = OutboxSandbox(failing=3)
    relays, seen = EgressRelays(), list[str]()
    await relays.start("s1", sandbox, lambda r: seen.append(r.host))
    sandbox.outbox.add(_record("a.test"))
    await _until(lambda: seen == ["a.test"])
    assert sandbox.polls >= 4
    await relays.close()
