"""The outbox of a proxy whose records are reported elsewhere (sandbox/egress/outbox.py): bounded,
each record given out once, what it drops counted, a close ending the polls."""

from __future__ import annotations

import asyncio

import pytest

from code_interpreter_wire.errors import SandboxClosed
from sandbox.egress import EgressRecord
from sandbox.egress.outbox import MAX_REASON_CHARS, RECORDS_PER_POLL, EgressOutbox

pytestmark = pytest.mark.unit


def _record(reason: str = "ok") -> EgressRecord:
    return EgressRecord(0.0, "a.test", 443, "CONNECT", True, reason, None, 0, 0, 0.0)


async def test_the_outbox_is_bounded_counts_what_it_drops_and_gives_each_record_once() -> None:
    outbox = EgressOutbox(capacity=RECORDS_PER_POLL + 2)
    for i in range(RECORDS_PER_POLL + 5):
        outbox.add(_record(str(i)))
    outbox.add(_record("x" * (MAX_REASON_CHARS * 4)))  # dropped too: the outbox is full
    first = await outbox.take(0)
    assert [r.reason for r in first.records] == [str(i) for i in range(RECORDS_PER_POLL)]
    assert first.dropped == 4
    second = await outbox.take(0)
    assert [r.reason for r in second.records] == [str(RECORDS_PER_POLL), str(RECORDS_PER_POLL + 1)]
    assert second.dropped == 0
    assert (await outbox.take(0)).records == ()

    outbox.add(_record("y" * (MAX_REASON_CHARS * 4)))  # room again: kept, its reason cut
    (kept,) = (await outbox.take(0)).records
    assert len(kept.reason) <= MAX_REASON_CHARS + 3


async def test_a_poll_waits_for_a_record_and_a_close_ends_the_polls() -> None:
    outbox = EgressOutbox()
    waiting = asyncio.ensure_future(outbox.take(30))
    await asyncio.sleep(0)  # the poll is waiting
    assert not waiting.done()
    outbox.add(_record("late"))
    assert [r.reason for r in (await waiting).records] == ["late"]

    outbox.add(_record("left"))
    outbox.close()
    assert [r.reason for r in (await outbox.take(30)).records] == ["left"]  # what was left
    with pytest.raises(SandboxClosed, match="closed"):
        await outbox.take(30)
    assert await outbox.drained(0)
