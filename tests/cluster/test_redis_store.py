"""The shared store of cluster mode against a real redis-server: records, caps, claims and
tombstones hold across two store objects (as two replicas), and bad values are typed errors."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from code_interpreter_wire.spec import SandboxSpec
from orchestrator.cluster.coordination_store import CoordinationStore
from orchestrator.state_store.records import SessionRecord, SnapshotRecord
from orchestrator.state_store.redis_connection import (
    CorruptRecord,
    RedisConnection,
    StoreUnavailable,
)
from orchestrator.state_store.redis_store import RedisStore
from sandbox.saved_report import SavedState
from tests.cluster.redis_server import free_port, redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"t{abs(hash(request.node.name)) % 10**8}"  # each test its own keys


@pytest.fixture
async def stores(
    redis_url: str, prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two stores on one server, as two replicas would hold."""
    a = RedisStore(RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path / "snaps")
    b = RedisStore(RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path / "snaps")
    yield a, b
    await a.connection.close()
    await b.connection.close()


@pytest.fixture
def coordination_pair(
    stores: tuple[RedisStore, RedisStore],
) -> tuple[CoordinationStore, CoordinationStore]:
    """What the two replicas coordinate through, in the same Redis."""
    a, b = stores
    return CoordinationStore(a.connection), CoordinationStore(b.connection)


def _session(sid: str, owner: str = "k1", **fields: object) -> SessionRecord:
    values: dict[str, object] = {"backend": "ray", "spec": SandboxSpec(), **fields}
    return SessionRecord.model_validate({"id": sid, "owner": owner, **values})


def _snapshot(snap_id: str, owner: str = "k1", **fields: object) -> SnapshotRecord:
    report = SavedState(saved=["x"], files=1)
    return SnapshotRecord(
        id=snap_id,
        owner=owner,
        kind="snapshot",
        session_id="s-1",
        backend="ray",
        spec=SandboxSpec(),
        report=report,
        **fields,
    )


async def test_redis_store_sessions_round_trip_across_replicas(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    a, b = stores
    await a.put_session(_session("s-1", sandbox_handle="cir-abc", state_since=1.0))
    await a.put_session(_session("s-2", owner="k2", state_since=2.0))
    await a.put_session(_session("s-3", state="paused", backend="local", state_since=3.0))
    got = await b.get_session("s-1")
    assert got is not None and got.sandbox_handle == "cir-abc" and got.owner == "k1"
    assert await b.get_session("s-none") is None
    assert [r.id for r in await b.sessions(owner="k1")] == ["s-1", "s-3"]
    assert [r.id for r in await b.sessions()] == ["s-1", "s-2", "s-3"]
    assert [r.id for r in await b.sessions(state="running")] == ["s-1", "s-2"]
    assert [r.id for r in await b.sessions(backend="local")] == ["s-3"]
    assert [r.id for r in await b.sessions(before=2.5)] == ["s-1", "s-2"]
    assert await b.count_sessions("k1", "running") == 1
    await b.delete_session("s-1")
    assert await a.get_session("s-1") is None
    assert [r.id for r in await a.sessions(owner="k1")] == ["s-3"]


async def test_redis_store_scan_walks_every_session_a_piece_at_a_time(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    a, _ = stores
    for i in range(25):
        await a.put_session(_session(f"s-{i}"))
    seen: set[str] = set()
    cursor, steps = 0, 0
    while True:
        cursor, records = await a.scan_sessions(cursor, 5)
        seen |= {r.id for r in records}
        steps += 1
        if cursor == 0:
            break
    assert seen == {f"s-{i}" for i in range(25)}
    assert steps > 1


async def test_redis_store_walk_sees_only_running_sessions(
    stores: tuple[RedisStore, RedisStore],
    redis_url: str,
    prefix: str,
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    """The reaper's walk is the running set, not every key (ended sessions' claims and
    tombstones, paused records); a record gone leaves the set."""
    ca, _ = coordination_pair
    a, _ = stores
    await a.put_session(_session("s-run"))
    await a.put_session(_session("s-paused", state="paused", backend="local"))
    await a.put_session(_session("s-gone"))
    for i in range(300):  # what ended sessions leave behind
        await ca.end(f"s-old-{i}", "k1", "was deleted")
    await a.delete_session("s-gone")
    raw = redis.Redis.from_url(redis_url)
    raw.sadd(f"{prefix}:running", "s-stale")  # a record lost without its set entry
    cursor, records = await a.scan_sessions(0, 10)
    assert cursor == 0  # one step: 3 members, not 600 keys
    assert [r.id for r in records] == ["s-run"]
    assert {m.decode() for m in raw.smembers(f"{prefix}:running")} == {"s-run"}
    raw.close()


async def test_a_handle_the_record_no_longer_names_leaves_the_named_set(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    """Paused (no sandbox), then resumed in another: the orphan sweep may end the old actor."""
    a, b = stores
    await a.put_session(_session("s-1", sandbox_handle="cir-old"))
    assert await b.handles_named(["cir-old"]) == {"cir-old"}
    await a.put_session(_session("s-1", state="paused", sandbox_handle=None))
    assert await b.handles_named(["cir-old"]) == set()
    await b.put_session(_session("s-1", sandbox_handle="cir-new"))
    assert await a.handles_named(["cir-old", "cir-new"]) == {"cir-new"}
    assert [r.id for r in await a.sessions(state="running")] == ["s-1"]


async def test_a_paused_machine_is_named_by_its_record(
    stores: tuple[RedisStore, RedisStore], redis_url: str, prefix: str
) -> None:
    """A session paused whole names its machine's image (the orphan sweep must not end it)
    until it resumes or is deleted; and one the set misses (a record written before the set
    kept paused machines') is found by reading the records, and put back."""
    a, b = stores
    await a.put_session(_session("s-1", sandbox_handle="cir-1"))
    await a.put_session(
        _session("s-1", state="paused", sandbox_handle="cir-1", suspended="machine-1")
    )
    assert await b.handles_named(["cir-1", "machine-1"]) == {"cir-1", "machine-1"}
    await b.put_session(_session("s-1", sandbox_handle="cir-2"))  # woken in another actor
    assert await a.handles_named(["cir-1", "machine-1", "cir-2"]) == {"cir-2"}
    await a.put_session(
        _session("s-2", state="paused", sandbox_handle="cir-3", suspended="machine-2")
    )
    await b.delete_session("s-2")
    assert await a.handles_named(["cir-3", "machine-2"]) == set()

    await a.put_session(
        _session("s-3", state="paused", sandbox_handle="cir-4", suspended="machine-3")
    )
    raw = redis.Redis.from_url(redis_url)
    raw.srem(f"{prefix}:handles", "machine-3")  # as a record of an older release left it
    raw.close()
    assert await a.handles_named(["machine-3"]) == set()
    asked = {"machine-3", "machine-1", "cir-2", "cir-none"}
    assert await b.handles_in_records(asked) == {"machine-3", "cir-2"}
    assert await a.handles_named(["machine-3"]) == {"machine-3"}
    # A record that cannot be read may name any of them: none is taken for an orphan.
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{prefix}:session:s-bad", b"{not json")
    raw.close()
    assert await b.handles_in_records({"machine-1", "cir-none"}) == {"machine-1", "cir-none"}


async def test_redis_store_handles_named_answers_each_handle(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """Asked handle by handle: a listing cut at `max_listed` never makes a live session's
    sandbox look unnamed (the orphan sweep would end it)."""
    store = RedisStore(
        RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path, max_listed=3
    )
    for i in range(10):
        await store.put_session(_session(f"s-{i}", sandbox_handle=f"cir-{i}"))
    await store.delete_session("s-9")
    asked = [f"cir-{i}" for i in range(10)] + ["cir-none"]
    assert await store.handles_named(asked) == {f"cir-{i}" for i in range(9)}
    assert await store.handles_named([]) == set()
    await store.connection.close()


async def test_redis_store_labels_never_bring_back_a_deleted_record(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    a, b = stores
    await a.put_session(_session("s-1", labels={"x": "1", "y": "1"}))
    assert await b.set_session_labels("s-1", {"x": "2"}) == {"x": "2", "y": "1"}
    # Another replica, from its older copy, changes another label: both stand.
    assert await a.set_session_labels("s-1", {"y": None, "z": "1"}) == {"x": "2", "z": "1"}
    got = await a.get_session("s-1")
    assert got is not None and got.labels == {"x": "2", "z": "1"}
    await a.delete_session("s-1")
    assert await b.set_session_labels("s-1", {"x": "3"}) is None
    assert await a.get_session("s-1") is None


async def test_redis_store_a_pause_and_a_label_set_through_two_replicas_both_stand(
    stores: tuple[RedisStore, RedisStore], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """Replica B sets labels while replica A pauses the session from its older copy: the
    pause written between B's read and B's write makes B's write try again on the paused
    record (it never brings back "running"), and A's next whole record keeps B's labels."""
    a, _ = stores
    running = _session("s-1", sandbox_handle="cir-1", labels={"timeout": "1"})
    await a.put_session(running)
    paused = running.model_copy(
        update={"state": "paused", "sandbox_handle": None, "suspended": "img-1"}
    )
    key = a.session_key("s-1")
    other_replica = redis.Redis.from_url(redis_url)

    class PausedMeanwhile(RedisStore):
        """B's store: right after it reads the record to set labels, A's pause lands (once,
        written at once by another connection, before B writes)."""

        reads = 0

        def _load(self, kind: type[Any], raw: bytes | None, key_read: str) -> Any:
            if key_read == key:
                self.reads += 1
                if self.reads == 1:
                    other_replica.set(key, paused.model_dump_json())
            return super()._load(kind, raw, key_read)

    b = PausedMeanwhile(RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path / "s")
    try:
        assert await b.set_session_labels("s-1", {"timeout": "2"}) == {"timeout": "2"}
        assert b.reads == 2  # the first write did not hold: tried again on the paused record
        got = await a.get_session("s-1")
        assert got is not None
        assert (got.state, got.suspended, got.labels) == ("paused", "img-1", {"timeout": "2"})
        # A's next whole write, from its copy with the old labels, keeps B's.
        await a.put_session(paused.model_copy(update={"labels": {"timeout": "1"}}))
        got = await a.get_session("s-1")
        assert got is not None and got.labels == {"timeout": "2"}
    finally:
        await b.connection.close()
        other_replica.close()


async def test_redis_store_listings_stop_at_their_cap(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    store = RedisStore(
        RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path, max_listed=7
    )
    for i in range(20):
        await store.put_session(_session(f"s-{i}"))
    assert len(await store.sessions()) == 7
    assert len(await store.sessions(owner="k1")) == 7
    await store.connection.close()


async def test_redis_store_every_key_is_under_its_prefix(
    stores: tuple[RedisStore, RedisStore],
    redis_url: str,
    prefix: str,
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, _ = coordination_pair
    a, _ = stores
    await a.put_session(_session("s-1"))
    await a.put_snapshot(_snapshot("snap-1"))
    assert await ca.admit("k1", "s-1", 5, 5) is None
    assert await ca.end("s-1", "k1", "was deleted") == (True, "was deleted")
    assert await ca.admit("k1", "s-2", 5, 5) is None
    raw = redis.Redis.from_url(redis_url)
    keys = [k.decode() for k in raw.scan_iter(match=f"{prefix}:*")]
    assert len(keys) >= 8
    other = [k.decode() for k in raw.scan_iter() if not k.decode().split(":")[0].startswith("t")]
    assert other == []
    raw.close()


async def test_redis_store_a_corrupt_value_is_a_typed_error(
    stores: tuple[RedisStore, RedisStore],
    redis_url: str,
    prefix: str,
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, _ = coordination_pair
    a, _ = stores
    await a.put_session(_session("s-good"))
    await a.put_session(_session("s-bad"))
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{prefix}:session:s-bad", b'{"id": "s-bad", "owner": 3}')
    raw.set(f"{prefix}:ended:s-x", b"\xff\xfe not json")
    raw.hset(f"{prefix}:slot-details", "s-y", b"[]")
    raw.close()
    with pytest.raises(CorruptRecord, match="corrupt SessionRecord"):
        await a.get_session("s-bad")
    with pytest.raises(CorruptRecord, match="corrupt Tombstone"):
        await ca.ended("s-x")
    # A listing skips the bad one (logged) rather than hide every other record.
    assert [r.id for r in await a.sessions(owner="k1")] == ["s-good"]
    await a.delete_session("s-bad")  # deletable all the same
    assert await a.get_session("s-bad") is None
    await ca.release("s-y")  # a corrupt slot is released all the same


async def test_redis_store_admission_holds_the_caps(
    stores: tuple[RedisStore, RedisStore],
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, cb = coordination_pair
    assert await ca.admit("k1", "s-1", 2, 3) is None
    assert await cb.admit("k1", "s-1", 2, 3) is None  # the same id twice: one place
    assert await cb.admit("k1", "s-2", 2, 3) is None
    why = await ca.admit("k1", "s-3", 2, 3)
    assert why is not None and "API key holds its maximum of 2 sessions" in why
    assert await cb.admit("k2", "s-4", 2, 3) is None
    why = await cb.admit("k3", "s-5", 2, 3)
    assert why is not None and "maximum of 3 sessions (3 across its replicas)" in why
    assert await ca.slots_held() == 3 and await ca.slots_held("k1") == 2
    await cb.release("s-1")
    await cb.release("s-1")  # idempotent
    assert await ca.slots_held() == 2 and await ca.slots_held("k1") == 1
    assert await ca.admit("k1", "s-3", 2, 3) is None


async def test_redis_store_concurrent_admissions_never_pass_the_cap(
    stores: tuple[RedisStore, RedisStore],
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, cb = coordination_pair
    admitted: list[str] = []

    async def create(coordination: CoordinationStore, n: int) -> None:
        for i in range(15):
            sid = f"s-{n}-{i}"
            if await coordination.admit("k1", sid, 7, 100) is None:
                admitted.append(sid)

    await asyncio.gather(*(create(c, n) for n, c in enumerate([ca, cb, ca, cb])))
    assert len(admitted) == 7
    assert await ca.slots_held("k1") == 7


async def test_redis_store_concurrent_admissions_never_pass_the_total_cap(
    stores: tuple[RedisStore, RedisStore],
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, cb = coordination_pair
    admitted: list[str] = []

    async def create(coordination: CoordinationStore, n: int) -> None:
        for i in range(10):
            sid = f"s-{n}-{i}"
            if await coordination.admit(f"k{i % 4}", sid, 100, 9) is None:  # 4 keys, 9 places
                admitted.append(sid)

    await asyncio.gather(*(create(c, n) for n, c in enumerate([ca, cb, ca, cb])))
    assert len(admitted) == 9
    assert await ca.slots_held() == 9
    assert sum([await ca.slots_held(f"k{i}") for i in range(4)]) == 9


async def test_redis_store_end_is_won_exactly_once(
    stores: tuple[RedisStore, RedisStore],
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    """Claim, tombstone and place given back are one step: every loser reads the winner's
    reason (never a missing tombstone), and the place is free once anyone ended it."""
    ca, cb = coordination_pair
    assert await ca.admit("k1", "s-1", 5, 5) is None
    ends = await asyncio.gather(
        *(c.end("s-1", "k1", f"why {n}") for n, c in enumerate([ca, cb] * 4))
    )
    winners = [why for won, why in ends if won]
    assert len(winners) == 1
    assert {why for _, why in ends} == set(winners)  # the losers say the winner's reason
    assert await ca.slots_held() == 0 and await ca.slots_held("k1") == 0
    assert await cb.ended("s-1") == ("k1", winners[0])
    assert await cb.end("s-2", "k2", "lost: n1") == (True, "lost: n1")
    assert await ca.end("s-2", "k2", "was deleted") == (False, "lost: n1")


async def test_redis_store_tombstones_are_shared_and_expire(
    stores: tuple[RedisStore, RedisStore],
    redis_url: str,
    prefix: str,
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, cb = coordination_pair
    assert await cb.ended("s-1") is None
    assert (await ca.end("s-1", "k1", "lost: node n1 died"))[0]
    assert await cb.ended("s-1") == ("k1", "lost: node n1 died")
    assert await cb.ended_among(["s-0", "s-1", "s-2"]) == {"s-1": ("k1", "lost: node n1 died")}
    assert await cb.ended_among([]) == {}
    raw = redis.Redis.from_url(redis_url)
    ttl = raw.ttl(f"{prefix}:ended:s-1")
    assert 0 < ttl <= 86400
    assert (await ca.end("s-9", "k1", "was deleted"))[0]
    assert 0 < raw.ttl(f"{prefix}:ended:s-9") <= 86400
    # The claim outlives a session's longest life and its tombstone: no second end, ever.
    assert raw.ttl(f"{prefix}:claim:s-9") > 86400 + 86400
    raw.close()


async def test_redis_store_abandoned_slots_are_found(
    stores: tuple[RedisStore, RedisStore],
    coordination_pair: tuple[CoordinationStore, CoordinationStore],
) -> None:
    ca, _ = coordination_pair
    a, _ = stores
    assert await ca.admit("k1", "s-recorded", 5, 5) is None
    assert await ca.admit("k1", "s-abandoned", 5, 5) is None
    await a.put_session(_session("s-recorded"))
    assert await ca.abandoned_slots(older_than_s=3600, most=10) == []  # both too young to tell
    assert await ca.abandoned_slots(older_than_s=-1, most=10) == ["s-abandoned"]
    for i in range(250):  # more than a page of old slots, most of them recorded
        assert await ca.admit("k2", f"s-{i}", 500, 500) is None
        if i != 240:
            await a.put_session(_session(f"s-{i}", owner="k2"))
    assert sorted(await ca.abandoned_slots(older_than_s=-1, most=10)) == ["s-240", "s-abandoned"]
    assert len(await ca.abandoned_slots(older_than_s=-1, most=1)) == 1


async def test_redis_store_snapshots(stores: tuple[RedisStore, RedisStore], tmp_path: Path) -> None:
    a, b = stores
    await a.put_snapshot(_snapshot("snap-1", bytes=100, created_at=1.0))
    await a.put_snapshot(_snapshot("snap-2", bytes=50, created_at=2.0, name="two"))
    await a.put_snapshot(_snapshot("snap-3", owner="k2", bytes=7))
    files = b.files_of("snap-1")
    files.mkdir()
    (files / "state").write_text("x")
    _left_long_ago(tmp_path / "snaps" / "stray")
    (tmp_path / "snaps" / "under-way").mkdir()  # another replica's save, not recorded yet
    assert [r.id for r in await b.snapshots(owner="k1")] == ["snap-2", "snap-1"]
    assert [r.id for r in await b.snapshots(owner="k2", kind="snapshot")] == ["snap-3"]
    assert await b.snapshots(session_id="s-other") == []
    assert await b.usage("k1") == (2, 150)
    assert [p.name for p in await b.orphan_files()] == ["stray"]
    await b.delete_snapshot("snap-1")
    assert await a.get_snapshot("snap-1") is None and not files.exists()
    with pytest.raises(ValueError, match="not a snapshot id"):
        a.files_of("../etc")


async def test_redis_store_orphan_files_never_on_a_cut_listing(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    store = RedisStore(
        RedisConnection(redis_url, prefix=prefix), snapshots_dir=tmp_path, max_listed=2
    )
    for i in range(5):
        await store.put_snapshot(_snapshot(f"snap-{i}"))
        store.files_of(f"snap-{i}").mkdir()
    _left_long_ago(tmp_path / "stray")
    assert [p.name for p in await store.orphan_files()] == ["stray"]
    await store.connection.close()


async def test_redis_store_unreachable_is_a_typed_error(tmp_path: Path) -> None:
    store = RedisStore(
        RedisConnection(f"redis://:secret@127.0.0.1:{free_port()}/0", prefix="x"),
        snapshots_dir=tmp_path,
    )
    with pytest.raises(StoreUnavailable, match="shared session store") as caught:
        await store.get_session("s-1")
    assert "secret" not in str(caught.value)
    with pytest.raises(StoreUnavailable):
        await CoordinationStore(store.connection).admit("k", "s-1", 1, 1)
    await store.connection.close()


def test_redis_store_url_password_is_never_shown() -> None:
    from pydantic import ValidationError

    from orchestrator.config import Settings

    settings = Settings(api_keys=["k"], store_url="redis://:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.store_url)
    with pytest.raises(ValidationError) as caught:
        Settings(api_keys=["k"], store_url="http://:hunter2@127.0.0.1:1/0")
    assert "store_url must be redis://" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def _left_long_ago(directory: Path) -> None:
    """A saved state's directory a crash left: written to two hours ago, never since."""
    directory.mkdir()
    (directory / "namespace").write_text("x")
    then = time.time() - 7200
    for path in (directory / "namespace", directory):
        os.utime(path, (then, then))
