"""The audit log in cluster mode's shared store, against a real redis-server on 127.0.0.1:
two replicas' appends share one order, a batch appended twice is kept once, filters and paging
(across the union of kinds, and with the work of one call bounded), retention."""

from __future__ import annotations

import time
import uuid

import pytest

from orchestrator.state_store.audit_store import AuditEvent, AuditQuery
from orchestrator.state_store.redis_audit import RedisAudit
from orchestrator.state_store.redis_store import RedisStore
from orchestrator.state_store.sqlite_store import SqliteStore

# Redis alone: the store pair of tests/governance/conftest.py, its Redis kind.
pytestmark = pytest.mark.parametrize("store_pair", ["redis"], indirect=True)


@pytest.fixture
def replicas(
    store_pair: tuple[SqliteStore | RedisStore, SqliteStore | RedisStore],
) -> tuple[RedisStore, RedisStore]:
    """Two replicas' handles on one store (a key prefix of the test's own)."""
    a, b = store_pair
    assert isinstance(a, RedisStore) and isinstance(b, RedisStore)
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


def test_appends_of_two_replicas_share_one_order_and_a_repeat_is_kept_once(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    a, b = replicas
    first = [event(i) for i in range(3)]
    a.audit.append_events(first)
    b.audit.append_events([event(i) for i in range(3, 6)])
    a.audit.append_events(first)  # again, as after a write whose outcome was unknown
    got = b.audit.query_events(AuditQuery())
    assert numbers(got) == [5, 4, 3, 2, 1, 0]
    assert [e.seq for e in got] == [6, 5, 4, 3, 2, 1]
    assert got[0].principal == "alice" and got[0].session_id == "s-2"


def test_filters_and_paging_over_every_index(replicas: tuple[RedisStore, RedisStore]) -> None:
    store = replicas[0].audit
    kinds = ["execution", "command", "file.upload"]
    store.append_events(
        [event(i, kind=kinds[i % 3], owner="p_a" if i % 2 else "p_b") for i in range(60)]
    )

    def walk(query: AuditQuery) -> list[int]:
        seen: list[int] = []
        while True:
            page = store.query_page(query)
            seen += numbers(page.events)
            if page.next_before is None:
                return seen
            query = query.model_copy(update={"before_seq": page.next_before})

    assert walk(AuditQuery(limit=7)) == list(range(59, -1, -1))
    assert walk(AuditQuery(owner="p_a", limit=4)) == list(range(59, 0, -2))
    assert walk(AuditQuery(principal="bob", limit=9)) == list(range(58, -1, -2))
    assert walk(AuditQuery(session_id="s-1", limit=3)) == list(range(58, -1, -3))
    two = AuditQuery(kinds=["command", "file.upload"], limit=5)
    assert walk(two) == [i for i in range(59, -1, -1) if i % 3]
    mixed = AuditQuery(owner="p_a", kinds=["execution"], since=1_700_000_030.0, limit=100)
    assert walk(mixed) == [i for i in range(59, 29, -1) if i % 2 and i % 3 == 0]
    assert walk(AuditQuery(until=1_700_000_003.0)) == [2, 1, 0]
    assert walk(AuditQuery(owner="nobody")) == []


def test_one_call_looks_at_a_bounded_number_of_events_and_says_where_to_go_on(
    replicas: tuple[RedisStore, RedisStore], redis_url: str
) -> None:
    store = replicas[0]
    store.audit.append_events([event(i) for i in range(2400)])
    # Times are no index: a query by time alone walks every event newer than it.
    bounded = RedisAudit(store._redis, store._key, store._errors, max_scanned=1000)
    at = 1_700_000_000.0 + 1200
    query = AuditQuery(since=at - 0.5, until=at + 0.5, limit=10)
    pages = 0
    found: list[int] = []
    while True:
        page = bounded.query_page(query)
        pages += 1
        found += numbers(page.events)
        if page.next_before is None:
            break
        query = query.model_copy(update={"before_seq": page.next_before})
    assert found == [1200]
    # 1199 newer events (and, past it, those within the `since` slack) at most ~1000 a call.
    assert pages >= 2


def test_retention_by_age_and_by_count_leaves_no_index_behind(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    store = replicas[0]
    store.audit.append_events([event(i) for i in range(1100)])
    assert store.audit.delete_events_before(1_700_000_000.0 + 600) == 600
    left = store.audit.query_events(AuditQuery(limit=1000))
    assert len(left) == 500 and min(numbers(left)) == 600
    assert store.audit.keep_newest(100) == 400
    assert numbers(store.audit.query_events(AuditQuery(limit=1000))) == list(range(1099, 999, -1))
    assert store.audit.delete_events_before(time.time()) == 100
    prefix = store._p
    leftover = list(store._redis.scan_iter(match=f"{prefix}:audit:*"))
    assert [k.decode() for k in leftover] == [f"{prefix}:audit:seq"]
