"""The outbox of a proxy whose records are reported elsewhere (sandbox/egress/outbox.py): bounded,
each record given out once, what it drops counted, a close ending the polls."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from code_interpreter_wire.errors import SandboxClosed
from sandbox.egress import EgressRecord
from sandbox.egress.ledger import MAX_METHOD_CHARS
from sandbox.egress.outbox import MAX_HOST_CHARS, MAX_REASON_CHARS, RECORDS_PER_POLL, EgressOutbox

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
    assert len(kept.reason) == MAX_REASON_CHARS and kept.reason.endswith("...")
    outbox.add(dataclasses.replace(_record(), method="GET" * 20000, host="h" * 60000))
    (cut,) = (await outbox.take(0)).records  # what a record holds is bounded, every field
    assert len(cut.method) == MAX_METHOD_CHARS and len(cut.host) == MAX_HOST_CHARS


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


async def test_a_waiting_poll_is_ended_by_a_close() -> None:
    outbox = EgressOutbox()
    waiting = asyncio.ensure_future(outbox.take(30))
    await asyncio.sleep(0)
    outbox.close()
    async with asyncio.timeout(5):  # not the poll's 30 s: the close woke it
        with pytest.raises(SandboxClosed):
            await waiting


async def test_pollers_at_once_take_each_record_once() -> None:
    outbox = EgressOutbox()
    polls = [asyncio.ensure_future(outbox.take(30)) for _ in range(3)]
    await asyncio.sleep(0)
    for i in range(5):
        outbox.add(_record(str(i)))
    await asyncio.sleep(0)
    outbox.close()  # the polls that found nothing end
    batches = await asyncio.gather(*polls, return_exceptions=True)
    taken = [r.reason for b in batches if not isinstance(b, BaseException) for r in b.records]
    assert sorted(taken) == ["0", "1", "2", "3", "4"]


async def test_drained_waits_for_a_poller_and_leftovers_empty_it() -> None:
    outbox = EgressOutbox()
    outbox.add(_record("a"))
    outbox.close()
    draining = asyncio.ensure_future(outbox.drained(30))
    await asyncio.sleep(0)
    assert [r.reason for r in (await outbox.take(0)).records] == ["a"]
    async with asyncio.timeout(5):
        assert await draining
    # A connection the proxy's close was still flushing ends after the close: still kept.
    outbox.add(_record("late"))
    assert not await outbox.drained(0)
    assert [r.reason for r in outbox.leftovers()[0]] == ["late"]
    assert outbox.leftovers() == ([], 0)
