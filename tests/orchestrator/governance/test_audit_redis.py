"""The audit log in cluster mode's shared store, against a real redis-server on 127.0.0.1:
two replicas' appends share one order, a batch appended twice is kept once, filters and paging
(across the union of kinds, and with the work of one call bounded), retention."""

from __future__ import annotations

import time
import uuid

import pytest

from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.governance.stores.redis_audit import RedisAudit
from tests.orchestrator.governance.store_handles import StoreHandle

# Redis alone: the store pair of tests/orchestrator/governance/conftest.py, its Redis kind.
pytestmark = pytest.mark.parametrize("store_pair", ["redis"], indirect=True)


@pytest.fixture
def replicas(
    store_pair: tuple[StoreHandle, StoreHandle],
) -> tuple[StoreHandle, StoreHandle]:
    """Two replicas' handles on one store (a key prefix of the test's own)."""
    a, b = store_pair
    assert isinstance(a, StoreHandle) and isinstance(b, StoreHandle)
    return a, b


def event(i: int, kind: str = "execution", owner: str = "p_a", **fields: object) -> AuditEvent:
    values: dict[str, object] = {
        "id": uuid.uuid4().hex,
        "time": 1_700_000_000.0 + i,
        "kind": kind,
        "owner": owner,
        "principal": {"p_a": "alice", "p_b": "bob"}.get(owner, owner),
        "session_id": f"s-{i % 3}",
        "details": {"i": i},
        **fields,
    }
    return AuditEvent.model_validate(values)


def numbers(events: list[AuditEvent]) -> list[int]:
    return [e.details["i"] for e in events]


async def test_appends_of_two_replicas_share_one_order_and_a_repeat_is_kept_once(
    replicas: tuple[StoreHandle, StoreHandle],
) -> None:
    a, b = replicas
    first = [event(i) for i in range(3)]
    await a.audit.append_events(first)
    await b.audit.append_events([event(i) for i in range(3, 6)])
    await a.audit.append_events(first)  # again, as after a write whose outcome was unknown
    got = await b.audit.query_events(AuditQuery())
    assert numbers(got) == [5, 4, 3, 2, 1, 0]
    assert [e.seq for e in got] == [6, 5, 4, 3, 2, 1]
    assert got[0].principal == "alice" and got[0].session_id == "s-2"


async def test_filters_and_paging_over_every_index(
    replicas: tuple[StoreHandle, StoreHandle],
) -> None:
    store = replicas[0].audit
    kinds = ["execution", "command", "file.upload"]
    await store.append_events(
        [event(i, kind=kinds[i % 3], owner="p_a" if i % 2 else "p_b") for i in range(60)]
    )

    async def walk(query: AuditQuery) -> list[int]:
        seen: list[int] = []
        while True:
            page = await store.query_page(query)
            seen += numbers(page.events)
            if page.next_before is None:
                return seen
            query = query.model_copy(update={"before_seq": page.next_before})

    assert await walk(AuditQuery(limit=7)) == list(range(59, -1, -1))
    assert await walk(AuditQuery(owner="p_a", limit=4)) == list(range(59, 0, -2))
    assert await walk(AuditQuery(principal="bob", limit=9)) == list(range(58, -1, -2))
    assert await walk(AuditQuery(session_id="s-1", limit=3)) == list(range(58, -1, -3))
    two = AuditQuery(kinds=["command", "file.upload"], limit=5)
    assert await walk(two) == [i for i in range(59, -1, -1) if i % 3]
    mixed = AuditQuery(owner="p_a", kinds=["execution"], since=1_700_000_030.0, limit=100)
    assert await walk(mixed) == [i for i in range(59, 29, -1) if i % 2 and i % 3 == 0]
    assert await walk(AuditQuery(until=1_700_000_003.0)) == [2, 1, 0]
    assert await walk(AuditQuery(owner="nobody")) == []


async def test_one_call_looks_at_a_bounded_number_of_events_and_says_where_to_go_on(
    replicas: tuple[StoreHandle, StoreHandle], redis_url: str
) -> None:
    store = replicas[0]
    await store.audit.append_events([event(i) for i in range(2400)])
    # Times are no index: a query by time alone walks every event newer than it.
    bounded = RedisAudit(store.connection, max_scanned=1000)
    at = 1_700_000_000.0 + 1200
    query = AuditQuery(since=at - 0.5, until=at + 0.5, limit=10)
    pages = 0
    found: list[int] = []
    while True:
        page = await bounded.query_page(query)
        pages += 1
        found += numbers(page.events)
        if page.next_before is None:
            break
        query = query.model_copy(update={"before_seq": page.next_before})
    assert found == [1200]
    # 1199 newer events (and, past it, those within the `since` slack) at most ~1000 a call.
    assert pages >= 2


async def test_retention_by_age_and_by_count_leaves_no_index_behind(
    replicas: tuple[StoreHandle, StoreHandle],
) -> None:
    store = replicas[0]
    await store.audit.append_events([event(i) for i in range(1100)])
    assert await store.audit.delete_events_before(1_700_000_000.0 + 600) == 600
    left = await store.audit.query_events(AuditQuery(limit=1000))
    assert len(left) == 500 and min(numbers(left)) == 600
    assert await store.audit.keep_newest(100) == 400
    assert numbers(await store.audit.query_events(AuditQuery(limit=1000))) == list(
        range(1099, 999, -1)
    )
    assert await store.audit.delete_events_before(time.time()) == 100
    prefix = store.connection.prefix
    leftover = [k async for k in store.connection.client.scan_iter(match=f"{prefix}:audit:*")]
    assert [k.decode() for k in leftover] == [f"{prefix}:audit:seq"]
