"""The kept-outputs stores' quotas: what is evicted, in which order, and what asking for it says;
on this machine's disk and in the shared store of a cluster (a real redis-server), alike."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis

from code_interpreter_wire.results import Execution, Result
from orchestrator import outputs, shared_outputs
from orchestrator.outputs import KeptOutputs, OutputEvicted, OutputNotFound, OutputStore
from orchestrator.shared_outputs import SharedOutputStore
from orchestrator.state_store.redis_connection import RedisConnection, StoreUnavailable
from tests.orchestrator.conftest import store_refusing

pytestmark = pytest.mark.unit

PER_SESSION, TOTAL = 50_000, 80_000


def text(n: int) -> Execution:
    return Execution(stdout="x" * n)


def image(seed: int, n: int = 10_000) -> Execution:
    png = base64.b64encode(bytes([seed]) * n).decode()
    return Execution(results=[Result(png=png)])


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stored(store: KeptOutputs) -> int:
    """The bytes the store holds, counted where they are, checked against its own count."""
    if isinstance(store, OutputStore):  # small ones are held in memory, the rest on disk
        held = disk(store.root) + store.bytes_in_memory
        assert held == store.bytes_kept
        return held
    assert isinstance(store, SharedOutputStore)
    client = redis.Redis.from_url(store._connection.url)
    base = store._connection.key("out")
    held = sum(
        int(client.strlen(key))
        for pattern in (f"{base}:s:*:x:*", f"{base}:s:*:a:*")
        for key in client.scan_iter(pattern)
    )
    assert held == int(client.get(f"{base}:bytes") or 0)
    assert not list(client.scan_iter(f"{base}:t:*")), "a save left staged parts behind"
    return held


async def evicted(store: KeptOutputs, execution_id: str) -> bool:
    try:
        await (await store.open_execution("s1", execution_id)).close()
    except OutputEvicted:
        return True
    return False


async def saved(store: KeptOutputs, session_id: str, execution: Execution) -> str:
    """Saved and written."""
    execution_id = await store.save(session_id, execution)
    await store.settled(session_id, execution_id)
    return execution_id


def shared(url: str, prefix: str, timeout_s: float = 1.0) -> SharedOutputStore:
    """One replica's handle on the shared store under `prefix`."""
    connection = RedisConnection(url, prefix=prefix, timeout_s=timeout_s)
    return SharedOutputStore(connection, max_bytes_per_session=PER_SESSION, max_bytes_total=TOTAL)


@pytest.fixture
def disk_store(tmp_path: Path) -> OutputStore:
    s = OutputStore(tmp_path / "outputs", max_bytes_per_session=PER_SESSION, max_bytes_total=TOTAL)
    s.clear()
    return s


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def replicas(redis_url: str, prefix: str) -> AsyncIterator[list[SharedOutputStore]]:
    """Two replicas' handles on one shared store."""
    both = [shared(redis_url, prefix), shared(redis_url, prefix)]
    yield both
    for store in both:
        await store._connection.close()


@pytest.fixture(params=["disk", "shared"])
def store(request: pytest.FixtureRequest) -> KeptOutputs:
    if request.param == "disk":
        found: OutputStore = request.getfixturevalue("disk_store")
        return found
    both: list[SharedOutputStore] = request.getfixturevalue("replicas")
    return both[0]


async def test_a_session_evicts_its_own_oldest_first(store: KeptOutputs) -> None:
    ids = [await saved(store, "s1", text(10_000)) for _ in range(12)]
    assert stored(store) <= 50_000
    assert (await store.execution("s1", ids[-1])).stdout == "x" * 10_000
    with pytest.raises(OutputEvicted, match="run the code again"):
        await store.execution("s1", ids[0])
    with pytest.raises(OutputNotFound):
        await store.execution("s1", "e-never")


async def test_the_service_quota_evicts_the_oldest_of_anyone(store: KeptOutputs) -> None:
    first = await saved(store, "s1", text(20_000))
    await saved(store, "s1", text(20_000))
    for _ in range(3):
        newest = await saved(store, "s2", text(15_000))
    assert stored(store) <= 80_000
    with pytest.raises(OutputEvicted):
        await store.execution("s1", first)
    assert (await store.execution("s2", newest)).stdout


async def test_a_save_over_the_quota_with_an_image_kept_already_is_not_written(
    store: KeptOutputs,
) -> None:
    """An image is stored once: a new execution showing one an older one showed counts only its
    JSON at first, but if that JSON and the image together are over the quota, the evictions
    reach the new execution itself, and nothing of it is written."""
    await saved(store, "s1", image(1))
    big = Execution(stdout="x" * 30_000, results=image(1).results)
    over = await saved(store, "s1", big)
    with pytest.raises(OutputEvicted):
        await store.open_execution("s1", over)
    assert stored(store) == 0


async def test_an_image_stays_while_a_kept_execution_shows_it(store: KeptOutputs) -> None:
    old = await saved(store, "s1", image(1))
    artifact_id = (await store.execution("s1", old)).artifacts[0].id
    second = await saved(store, "s1", image(1))  # the same image again: stored once
    while not await evicted(store, old):
        await saved(store, "s1", text(5_000))
    kept = await store.artifact("s1", artifact_id)  # the second execution still shows it
    assert kept.media_type == "image/png"
    shown = kept.data if kept.path is None else kept.path.read_bytes()
    assert shown == bytes([1]) * 10_000
    while not await evicted(store, second):
        await saved(store, "s1", text(5_000))
    with pytest.raises(OutputEvicted):
        await store.artifact("s1", artifact_id)
    stored(store)


async def test_too_big_to_keep_and_drop(store: KeptOutputs) -> None:
    huge = await saved(store, "s1", text(60_000))
    with pytest.raises(OutputEvicted, match="not kept"):
        await store.open_execution("s1", huge)
    kept = await saved(store, "s1", text(10_000))
    await store.drop("s1")
    assert stored(store) == 0
    with pytest.raises(OutputNotFound):
        await store.open_execution("s1", kept)
    late = await saved(store, "s1", text(10_000))  # a run that finished as its session ended
    assert stored(store) == 0
    with pytest.raises(OutputNotFound):
        await store.open_execution("s1", late)


async def test_the_disk_never_holds_more_than_the_quota_even_mid_write(
    disk_store: OutputStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of the disk between a save's first file and its last (a test, an operator's
    `du`) sees the quota kept: what a save evicts is gone before what it keeps is written."""
    seen: list[int] = []
    write = outputs._write

    def measured(path: Path, data: bytes) -> None:
        seen.append(disk(disk_store.root) + len(data))
        write(path, data)

    monkeypatch.setattr(outputs, "_write", measured)
    for session in ("s1", "s2", "s1", "s2", "s3"):
        for _ in range(4):
            await saved(disk_store, session, text(12_000))
    assert len(seen) == 20 and max(seen) <= 80_000


async def test_a_save_answers_before_its_write_and_waits_past_the_cap(
    disk_store: OutputStore,
) -> None:
    """The id comes back at once; what reads it (or its image) right away finds it written; at
    most `WRITES_PENDING` writes are ever under way."""
    saves = [disk_store.save(f"s{i % 3}", image(i % 5)) for i in range(200)]
    ids = []
    for saving in saves:
        ids.append(await saving)
        assert disk_store.writes_pending <= outputs.WRITES_PENDING
    session, last = f"s{199 % 3}", ids[-1]
    await disk_store.settled(session, last)
    artifact_id = (await disk_store.execution(session, last)).artifacts[0].id
    await disk_store.settled(session, artifact_id)
    assert await disk_store.artifact(session, artifact_id)


async def test_a_write_that_fails_is_told_as_such(disk_store: OutputStore) -> None:
    """The id was given out before the write: if the write fails, a reader is told why."""
    (disk_store.root / "s-blocked").write_text("a file where the session's directory goes")
    execution_id = await disk_store.save("s-blocked", text(20_000))  # too long to hold
    await disk_store.settled("s-blocked", execution_id)
    with pytest.raises(OutputEvicted, match="could not be written"):
        await disk_store.execution("s-blocked", execution_id)
    await disk_store.close()


async def test_small_outputs_are_held_in_memory_within_their_bound(tmp_path: Path) -> None:
    """Small ones without images are held at once, counted in the quotas like the rest,
    evicted and dropped alike; past the memory bound they are written."""
    store = OutputStore(
        tmp_path / "outputs",
        max_bytes_per_session=PER_SESSION,
        max_bytes_total=TOTAL,
        max_memory_bytes=15_000,
    )
    store.clear()
    held = [await store.save("s1", text(3_000)) for _ in range(4)]
    assert store.writes_pending == 0 and 0 < store.bytes_in_memory <= 15_000
    assert not list(store.root.rglob("*.json"))
    assert (await store.execution("s1", held[0])).stdout == "x" * 3_000
    written = await saved(store, "s1", text(3_000))  # the bound reached: on disk
    assert (store.root / "s1" / f"{written}.json").is_file()
    assert stored(store) == store.bytes_kept
    while not await evicted(store, held[-1]):  # the oldest go first, held or written
        await saved(store, "s1", text(9_000))
    assert store.bytes_in_memory == 0 and stored(store) <= PER_SESSION
    await store.save("s2", text(10))
    await store.drop("s2")
    await store.drop("s1")
    assert stored(store) == 0 and store.bytes_in_memory == 0


async def test_held_and_written_outputs_are_evicted_oldest_first(disk_store: OutputStore) -> None:
    """Small ones held in memory and larger ones written share one order: the oldest go
    first, wherever they are kept."""
    kept = [await saved(disk_store, "s1", text(3_000 if i % 2 == 0 else 12_000)) for i in range(6)]
    assert disk_store.bytes_in_memory > 0 and list(disk_store.root.rglob("*.json"))
    await saved(disk_store, "s1", text(12_000))  # over the session's quota: two must go
    gone = [await evicted(disk_store, execution_id) for execution_id in kept]
    assert gone == [True, True, False, False, False, False]
    assert stored(disk_store) <= PER_SESSION


async def test_a_small_save_waits_its_turn_behind_a_write(disk_store: OutputStore) -> None:
    """Saves are kept in the order they were made (the quotas evict the oldest first): a
    small one made while a write is under way goes behind it, not ahead."""
    first = await disk_store.save("s1", image(1))
    second = await disk_store.save("s1", text(10))
    assert disk_store.writes_pending == 2
    await disk_store.settled("s1", second)
    assert (disk_store.root / "s1" / f"{second}.json").is_file()
    assert (await disk_store.execution("s1", first)).artifacts
    assert stored(disk_store) == disk_store.bytes_kept


# --- the shared store: what one replica keeps, another reads
async def test_what_one_replica_kept_another_reads_and_ends(
    replicas: list[SharedOutputStore],
) -> None:
    a, b = replicas
    execution_id = await a.save("s1", image(7))
    execution = await b.execution("s1", execution_id)  # no wait: kept before its id was given
    kept = await b.artifact("s1", execution.artifacts[0].id)
    assert kept.data == bytes([7]) * 10_000
    await b.drop("s1")
    with pytest.raises(OutputNotFound):
        await a.open_execution("s1", execution_id)
    assert stored(a) == 0


async def test_the_quotas_hold_across_replicas(replicas: list[SharedOutputStore]) -> None:
    """Each save is checked against what every replica kept: the evictions reach the other's."""
    a, b = replicas
    first = await a.save("s1", text(20_000))
    for i in range(6):
        await (b if i % 2 else a).save(f"s{2 + i % 2}", text(15_000))
        assert stored(a) <= TOTAL
    with pytest.raises(OutputEvicted, match="was evicted"):
        await b.open_execution("s1", first)


async def test_a_large_execution_is_read_in_chunks_and_cut_short_if_evicted(
    replicas: list[SharedOutputStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `_READ_WHOLE` a reader reads the kept value in chunks, never a copy (copies would be
    memory outside the quota): whole while it is kept, cut short once it is evicted."""
    monkeypatch.setattr(shared_outputs, "_READ_WHOLE", 1_000)
    monkeypatch.setattr(shared_outputs, "CHUNK_BYTES", 4_096)
    a, b = replicas
    big = await a.save("s1", text(30_000))
    whole = await (await b.open_execution("s1", big)).read()
    assert Execution.model_validate_json(whole).stdout == "x" * 30_000
    opened = await b.open_execution("s1", big)
    chunks = opened.chunks()
    first = await anext(chunks)
    while not await evicted(a, big):  # evicted from under the reader
        await a.save("s1", text(10_000))
    rest = [chunk async for chunk in chunks]
    assert len(first) == 4_096 and len(first) + sum(map(len, rest)) < opened.size


async def test_a_save_the_store_refused_is_told_as_unavailable(redis_url: str, prefix: str) -> None:
    """The store is down: the run's answer still comes (with its id); reading it says the
    store is unavailable (503), not that the output never was."""
    store = shared(redis_url.rsplit(":", 1)[0] + ":1/0", prefix)  # nothing listens on port 1
    try:
        execution_id = await store.save("s1", text(100))
        with pytest.raises(StoreUnavailable):
            await store.open_execution("s1", execution_id)
    finally:
        await store._connection.close()


async def test_a_session_ends_though_the_store_is_down(redis_url: str, prefix: str) -> None:
    """Dropping its outputs never fails a session's end: they stay until evicted."""
    store = shared(redis_url.rsplit(":", 1)[0] + ":1/0", prefix)
    try:
        await store.drop("s1")
    finally:
        await store._connection.close()


async def test_a_save_is_staged_in_pieces_and_taken_in_whole(
    replicas: list[SharedOutputStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No call carries a whole large part (each piece one short call), yet what is read back is
    the whole of it, and nothing staged stays behind."""
    monkeypatch.setattr(shared_outputs, "_STAGED_CHUNK", 1_000)
    a, b = replicas
    client = redis.Redis.from_url(a._connection.url)
    appended = _calls(client, "append")
    execution_id = await a.save("s1", image(9, 4_500))
    assert _calls(client, "append") - appended >= 4  # its image alone: 5 pieces, 4 appended
    execution = await b.execution("s1", execution_id)
    assert (await b.artifact("s1", execution.artifacts[0].id)).data == bytes([9]) * 4_500
    assert stored(a) > 4_500


async def test_a_save_whose_staged_parts_are_gone_is_told_as_not_written(
    replicas: list[SharedOutputStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged parts expire (a store so slow the save came after their time to live): the save
    keeps nothing half, and its id says it could not be written."""
    a, _ = replicas
    script = a._save
    client = redis.Redis.from_url(a._connection.url)

    async def after_expiry(args: list[Any]) -> object:
        for key in client.scan_iter(f"{a._connection.key('out')}:t:*"):
            client.delete(key)
        return await script(args=args)

    monkeypatch.setattr(a, "_save", after_expiry)
    execution_id = await a.save("s1", image(3))
    with pytest.raises(OutputEvicted, match="could not be written"):
        await a.open_execution("s1", execution_id)
    assert stored(a) == 0


async def test_a_part_staged_short_is_never_kept_short(
    replicas: list[SharedOutputStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged part that lost pieces (it expired midway, and later pieces made it again):
    the save is lost, never kept truncated."""
    a, _ = replicas
    stage = a._stage
    client = redis.Redis.from_url(a._connection.url)

    async def cut_short(key: str, data: bytes) -> None:
        await stage(key, data)
        client.set(key, data[len(data) // 2 :])  # only its later pieces are left

    monkeypatch.setattr(a, "_stage", cut_short)
    execution_id = await a.save("s1", text(5_000))
    with pytest.raises(OutputEvicted, match="could not be written"):
        await a.open_execution("s1", execution_id)
    assert stored(a) == 0


async def test_saves_at_once_after_an_outage_each_retry_their_share_of_drops(
    redis_url: str, prefix: str
) -> None:
    """Drops refused while the store was down, retried by many saves at once: none fails (a
    save is never failed by another's retry), and every drop is done."""
    a = shared(redis_url, prefix)
    try:
        ended = [await a.save(f"e{i}", text(100)) for i in range(5)]
        with store_refusing(redis_url):
            for i in range(5):
                await a.drop(f"e{i}")  # each refused
        await asyncio.gather(*(a.save(f"live{i}", text(100)) for i in range(4)))
        await asyncio.gather(*(a.save(f"more{i}", text(100)) for i in range(4)))
        for i, execution_id in enumerate(ended):
            with pytest.raises(OutputNotFound):
                await a.open_execution(f"e{i}", execution_id)
        assert not a._undropped
    finally:
        await a._connection.close()


def _calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran `command` so far."""
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


async def test_why_an_id_is_gone_is_remembered_for_the_newest_ids(
    replicas: list[SharedOutputStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its cap the oldest reason is forgotten (a 404 then), never all at once."""
    monkeypatch.setattr(shared_outputs, "_GONE_REMEMBERED", 3)
    a, b = replicas
    ids = [await a.save("s1", text(30_000)) for _ in range(6)]
    for execution_id in ids[:2]:  # their reasons pushed out by newer ones
        with pytest.raises(OutputNotFound):
            await b.open_execution("s1", execution_id)
    for execution_id in ids[2:5]:
        with pytest.raises(OutputEvicted, match="was evicted"):
            await b.open_execution("s1", execution_id)
    await (await b.open_execution("s1", ids[5])).close()
    client = redis.Redis.from_url(a._connection.url)
    gone = a._key("s1", "gone")
    assert client.hlen(gone) == 3 and 0 < client.ttl(gone) <= shared_outputs._GONE_KEPT_S


async def test_a_drop_the_store_refused_is_done_once_it_answers(
    redis_url: str, prefix: str
) -> None:
    """A session ends while the store refuses this replica (the test changes its password and
    drops its connections): its outputs stay, and go at this replica's next call the store
    answers."""
    a, b = shared(redis_url, prefix), shared(redis_url, prefix)
    try:
        ended = await a.save("s1", text(100))
        with store_refusing(redis_url):
            await a.drop("s1")  # refused: the store would not take its connection
        await (await b.open_execution("s1", ended)).close()
        kept = await a.save("s2", text(100))
        with pytest.raises(OutputNotFound):
            await b.open_execution("s1", ended)
        opened = await b.open_execution("s2", kept)
        await opened.close()
        assert stored(a) == opened.size  # only the live session's
    finally:
        for store in (a, b):
            await store._connection.close()
