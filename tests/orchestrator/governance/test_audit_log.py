"""The audit log's writer and its SQLite store, in this process with a real state.db: caps on
what one event holds, the bounded queue under a flood, paging and filters, retention."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.governance import audit_kinds as kinds
from orchestrator.governance.audit import (
    MAX_TEXT_CHARS,
    AuditLog,
    BadAuditQuery,
    command_line,
    end_reason,
    parse_time,
)
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.policy import Principal
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.settings_sections import AuditSection
from tests.orchestrator.governance.store_handles import StoreHandle, local_store

ADMIN = Principal(id="p_admin", name="root", admin=True)
ALICE = Principal(id="p_alice", name="alice")
BOB = Principal(id="p_bob", name="bob")
NAMES = {p.id: p.name for p in (ADMIN, ALICE, BOB)}


def settings(tmp_path: Path, **overrides: object) -> Settings:
    return Settings(auth_disabled=True, state_dir=tmp_path / "state", **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def log_and_store(tmp_path: Path) -> AsyncIterator[tuple[AuditLog, StoreHandle]]:
    store = local_store(tmp_path / "state")
    audit = AuditLog(
        AuditSection.of(settings(tmp_path, audit_max_code_chars=1000)), name_of=NAMES.__getitem__
    )
    audit.start(store.audit)
    yield audit, store
    await audit.close()
    await store.close()


async def written(
    audit: AuditLog, store: StoreHandle, count: int, total: int | None = None
) -> list[AuditEvent]:
    """The newest `count` events once the writer has written them, `total` in all (None:
    `count`) (a poll with a deadline: the writer may have taken an event off its queue and not
    yet stored it)."""
    deadline = time.monotonic() + 10
    while True:
        page = await store.audit.query_page(AuditQuery(limit=1000))
        if len(page.events) >= (total or count) and not audit.pending:
            return page.events[:count]
        assert time.monotonic() < deadline, f"{len(page.events)} of {count} events written"
        await asyncio.sleep(0.02)


async def test_events_carry_the_principals_name_and_come_back_in_order(
    log_and_store: tuple[AuditLog, StoreHandle],
) -> None:
    audit, store = log_and_store
    for i in range(5):
        audit.record(kinds.EXECUTION, owner=ALICE.id, session_id="s-1", details={"i": i})
    audit.record(kinds.COMMAND, owner=BOB.id, session_id="s-2", status="ok", duration_s=0.5)
    events = await written(audit, store, 6)
    assert [e.kind for e in events] == [kinds.COMMAND] + [kinds.EXECUTION] * 5
    assert [e.details.get("i") for e in events[1:]] == [4, 3, 2, 1, 0]  # newest first
    assert [e.principal for e in events] == ["bob"] + ["alice"] * 5
    assert events[0].status == "ok" and events[0].duration_s == 0.5
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == 6  # type: ignore[type-var]
    times = [e.time for e in events]
    assert times == sorted(times, reverse=True) and time.time() - times[0] < 10


async def test_code_over_the_cap_is_truncated_and_marked_and_other_text_is_bounded(
    log_and_store: tuple[AuditLog, StoreHandle],
) -> None:
    audit, store = log_and_store
    code = "x = 1\n" * 10_000  # 60,000 characters; the cap here is 1000
    audit.record(
        kinds.EXECUTION,
        owner=ALICE.id,
        details={
            "code": code,
            "reason": "r" * 100_000,
            "items": ["y" * 10_000] * 1000,
            "object": object(),
            "nested": {"a": [[["deep"] * 10] * 10] * 100, "b": {f"k{i}": i for i in range(99)}},
            **{f"field{i}": i for i in range(100)},
        },
    )
    audit.record(kinds.EXECUTION, owner=ALICE.id, details={"code": "print(1)"})
    short, long = await written(audit, store, 2)
    assert short.details == {"code": "print(1)"}  # not marked
    d = long.details
    assert d["code"] == code[:1000] and d["code_truncated"] is True and d["code_chars"] == 60_000
    assert len(d["reason"]) == MAX_TEXT_CHARS and d["reason_truncated"] is True
    assert len(d["items"]) == 64 and all(len(x) == MAX_TEXT_CHARS for x in d["items"])
    assert d["object"].startswith("<object object")
    assert d["nested"]["a"] == ["<list of 10>"] * 64  # two levels kept, then only a mark
    assert len(d["nested"]["b"]) == 32
    assert len(d) <= 32 + 4  # the fields kept, and the marks of those cut
    assert command_line(["echo", "a b"] * 10_000, None, 100).startswith("echo 'a b' echo")
    assert len(command_line(["x" * 10_000] * 10_000, None, 100)) <= 102


async def test_a_flood_is_bounded_by_the_queue_and_the_drops_are_counted_and_said(
    tmp_path: Path,
) -> None:
    store = local_store(tmp_path / "state")
    audit = AuditLog(
        AuditSection.of(settings(tmp_path, audit_queue_max=100)), name_of=NAMES.__getitem__
    )
    audit.start(store.audit)
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50_000):  # no await: the writer gets no turn, as under a burst
            audit.record(kinds.EGRESS_CONNECTION, owner=ALICE.id, details={"host": f"h{i}"})
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert audit.pending == 100
        assert audit.dropped == 49_900
        assert grown < 1 << 20, f"{grown} bytes held for 100 queued events"
        events = await written(audit, store, 101)
        dropped = [e for e in events if e.kind == kinds.AUDIT_DROPPED]
        assert len(dropped) == 1 and dropped[0].details == {"dropped": 49_900}
        assert dropped[0].owner == kinds.SERVICE_OWNER
        # Room again: events are kept again, and the next drop is said again.
        audit.record(kinds.EXECUTION, owner=ALICE.id)
        assert (await written(audit, store, 1, total=102))[0].kind == kinds.EXECUTION
    finally:
        await audit.close()
        await store.close()


async def test_close_flushes_what_is_queued_and_recording_after_it_never_raises(
    tmp_path: Path,
) -> None:
    store = local_store(tmp_path / "state")
    audit = AuditLog(AuditSection.of(settings(tmp_path)), name_of=NAMES.__getitem__)
    audit.start(store.audit)
    for _ in range(1234):
        audit.record(kinds.FILE_UPLOAD, owner=BOB.id, details={"path": "a", "bytes": 1})
    await audit.close()  # at once: the writer has not had a turn yet
    assert len(await store.audit.query_events(AuditQuery(limit=1000))) == 1000
    assert (await store.audit.query_page(AuditQuery(limit=1000))).next_before is not None
    audit.record(kinds.FILE_UPLOAD, owner=BOB.id)  # queued, never written: no error
    await store.close()


async def test_paging_and_filters(log_and_store: tuple[AuditLog, StoreHandle]) -> None:
    audit, store = log_and_store
    for i in range(30):
        owner = ALICE.id if i % 3 else BOB.id
        kind = kinds.EXECUTION if i % 2 else kinds.COMMAND
        audit.record(kind, owner=owner, session_id=f"s-{i % 5}", details={"i": i})
    await written(audit, store, 30)
    # Pages of 7, newest first, that together are the whole log, each once.
    seen: list[int] = []
    query = AuditQuery(limit=7)
    while True:
        page = await audit.query(ADMIN, query)
        seen += [e.details["i"] for e in page.events]
        if page.next_before is None:
            break
        query = query.model_copy(update={"before_seq": page.next_before})
    assert seen == list(range(29, -1, -1))
    # Filters: owner (a plain key sees only its own), session, kinds, a key by name.
    mine = await audit.query(ALICE, AuditQuery(limit=100))
    assert {e.owner for e in mine.events} == {ALICE.id} and len(mine.events) == 20
    theirs = await audit.query(ADMIN, AuditQuery(principal="bob", limit=100))
    assert {e.principal for e in theirs.events} == {"bob"} and len(theirs.events) == 10
    both = AuditQuery(session_id="s-1", kinds=[kinds.EXECUTION], limit=100)
    got = await audit.query(ADMIN, both)
    assert [e.details["i"] for e in got.events] == [21, 11, 1]
    with pytest.raises(PolicyDenied, match="only an admin key"):
        await audit.query(ALICE, AuditQuery(principal="bob"))
    own = await audit.query(ALICE, AuditQuery(principal="alice", limit=100))
    assert len(own.events) == 20
    # Time: since and until bound the events' times.
    events = (await audit.query(ADMIN, AuditQuery(limit=100))).events
    middle = events[10].time
    later = await audit.query(ADMIN, AuditQuery(since=middle, limit=100))
    assert all(e.time >= middle for e in later.events) and len(later.events) >= 11
    earlier = await audit.query(ADMIN, AuditQuery(until=middle, limit=100))
    assert all(e.time < middle for e in earlier.events)
    assert len(later.events) + len(earlier.events) == 30


async def test_retention_deletes_old_events_and_keeps_the_cursor_valid(
    log_and_store: tuple[AuditLog, StoreHandle],
) -> None:
    audit, store = log_and_store
    for i in range(6):
        audit.record(kinds.EXECUTION, owner=ALICE.id, details={"i": i})
    events = await written(audit, store, 6)
    newest = events[0]
    # A sweep "100 days later": everything is past the 90 days kept by default.
    assert await audit.sweep(now=time.time() + 100 * 86400, force=True) == 6
    assert await store.audit.query_events(AuditQuery()) == []
    audit.record(kinds.EXECUTION, owner=ALICE.id)
    after = await written(audit, store, 1)
    assert after[0].seq is not None and newest.seq is not None and after[0].seq > newest.seq
    # Rate-limited when not forced; and within the retention nothing goes.
    assert await audit.sweep() == 0
    assert await audit.sweep(force=True) == 0
    # By count: the newest kept.
    for i in range(10):
        audit.record(kinds.EXECUTION, owner=ALICE.id, details={"i": i})
    await written(audit, store, 11)
    assert await store.audit.keep_newest(4) == 7
    assert [e.details["i"] for e in await store.audit.query_events(AuditQuery())] == [9, 8, 7, 6]


def test_times_and_end_reasons_are_read_as_people_write_them() -> None:
    assert parse_time("1700000000") == 1700000000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1700000000.0
    assert parse_time("2023-11-14T22:13:20") == 1700000000.0  # UTC unless it says
    assert parse_time("2023-11-14T23:13:20+01:00") == 1700000000.0
    with pytest.raises(BadAuditQuery, match="not a time"):
        parse_time("yesterday")
    assert end_reason("was deleted") == "deleted"
    assert end_reason("was deleted after 604800 s paused") == "retention"
    assert end_reason("expired after 1200 s without activity") == "idle"
    assert end_reason("expired: it reached the maximum lifetime of 86400 s") == "lifetime"
    assert end_reason("lost: its node died") == "lost"
    assert end_reason("the service shut down") == "shutdown"
    assert end_reason("expired after 5 s without activity; it could not be paused (x)") == "idle"
