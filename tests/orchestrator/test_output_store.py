"""The kept-outputs store's quotas: what is evicted, in which order, and what asking for it says."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from code_interpreter_wire.results import Execution, Result
from orchestrator import outputs
from orchestrator.outputs import OutputEvicted, OutputNotFound, OutputStore

pytestmark = pytest.mark.unit


def text(n: int) -> Execution:
    return Execution(stdout="x" * n)


def image(seed: int, n: int = 10_000) -> Execution:
    png = base64.b64encode(bytes([seed]) * n).decode()
    return Execution(results=[Result(png=png)])


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evicted(store: OutputStore, execution_id: str) -> bool:
    try:
        store.open_execution("s1", execution_id).file.close()
    except OutputEvicted:
        return True
    return False


async def saved(store: OutputStore, session_id: str, execution: Execution) -> str:
    """Saved and written."""
    execution_id = await store.save(session_id, execution)
    await store.settled(session_id, execution_id)
    return execution_id


@pytest.fixture
def store(tmp_path: Path) -> OutputStore:
    s = OutputStore(tmp_path / "outputs", max_bytes_per_session=50_000, max_bytes_total=80_000)
    s.clear()
    return s


async def test_a_session_evicts_its_own_oldest_first(store: OutputStore) -> None:
    ids = [await saved(store, "s1", text(10_000)) for _ in range(12)]
    assert store.bytes_kept == disk(store.root) <= 50_000
    assert store.execution("s1", ids[-1]).stdout == "x" * 10_000
    with pytest.raises(OutputEvicted, match="run the code again"):
        store.execution("s1", ids[0])
    with pytest.raises(OutputNotFound):
        store.execution("s1", "e-never")


async def test_the_service_quota_evicts_the_oldest_of_anyone(store: OutputStore) -> None:
    first = await saved(store, "s1", text(20_000))
    await saved(store, "s1", text(20_000))
    for _ in range(3):
        newest = await saved(store, "s2", text(15_000))
    assert store.bytes_kept == disk(store.root) <= 80_000
    with pytest.raises(OutputEvicted):
        store.execution("s1", first)
    assert store.execution("s2", newest).stdout


async def test_the_disk_never_holds_more_than_the_quota_even_mid_write(
    store: OutputStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader of the disk between a save's first file and its last (a test, an operator's
    `du`) sees the quota kept: what a save evicts is gone before what it keeps is written."""
    seen: list[int] = []
    write = outputs._write

    def measured(path: Path, data: bytes) -> None:
        seen.append(disk(store.root) + len(data))
        write(path, data)

    monkeypatch.setattr(outputs, "_write", measured)
    for session in ("s1", "s2", "s1", "s2", "s3"):
        for _ in range(4):
            await saved(store, session, text(12_000))
    assert len(seen) == 20 and max(seen) <= 80_000


async def test_a_save_over_the_quota_with_an_image_kept_already_is_not_written(
    store: OutputStore,
) -> None:
    """An image is stored once: a new execution showing one an older one showed counts only its
    JSON at first, but if that JSON and the image together are over the quota, the evictions
    reach the new execution itself, and nothing of it is written."""
    await saved(store, "s1", image(1))
    big = Execution(stdout="x" * 30_000, results=image(1).results)
    over = await saved(store, "s1", big)
    with pytest.raises(OutputEvicted):
        store.open_execution("s1", over)
    assert store.bytes_kept == disk(store.root) == 0


async def test_an_image_stays_while_a_kept_execution_shows_it(store: OutputStore) -> None:
    old = await saved(store, "s1", image(1))
    artifact_id = store.execution("s1", old).artifacts[0].id
    second = await saved(store, "s1", image(1))  # the same image again: stored once
    while not evicted(store, old):
        await saved(store, "s1", text(5_000))
    assert store.artifact("s1", artifact_id)  # the second execution still shows it
    while not evicted(store, second):
        await saved(store, "s1", text(5_000))
    with pytest.raises(OutputEvicted):
        store.artifact("s1", artifact_id)
    assert store.bytes_kept == disk(store.root)


async def test_too_big_to_keep_and_drop(store: OutputStore) -> None:
    huge = await saved(store, "s1", text(60_000))
    with pytest.raises(OutputEvicted, match="not kept"):
        store.open_execution("s1", huge)
    await saved(store, "s1", text(10_000))
    store.drop("s1")
    assert store.bytes_kept == 0 and not (store.root / "s1").exists()


async def test_a_save_answers_before_its_write_and_waits_past_the_cap(store: OutputStore) -> None:
    """The id comes back at once; what reads it (or its image) right away finds it written; at
    most `_WRITES_PENDING` writes are ever under way."""
    saves = [store.save(f"s{i % 3}", image(i % 5)) for i in range(200)]
    ids = []
    for saving in saves:
        ids.append(await saving)
        assert store.writes_pending <= outputs._WRITES_PENDING
    session, last = f"s{199 % 3}", ids[-1]
    await store.settled(session, last)
    artifact_id = store.execution(session, last).artifacts[0].id
    await store.settled(session, artifact_id)
    assert store.artifact(session, artifact_id)


async def test_a_write_that_fails_is_told_as_such(store: OutputStore) -> None:
    """The id was given out before the write: if the write fails, a reader is told why."""
    (store.root / "s-blocked").write_text("a file where the session's directory goes")
    execution_id = await store.save("s-blocked", text(100))
    await store.settled("s-blocked", execution_id)
    with pytest.raises(OutputEvicted, match="could not be written"):
        store.execution("s-blocked", execution_id)
    await store.close()
