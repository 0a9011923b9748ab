"""The store of session records and saved states (SQLite under the state dir), and the checks on
what a kernel reports of its own state."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from code_interpreter_wire.spec import SandboxSpec
from orchestrator.state_store import SessionRecord, SnapshotRecord, SqliteDatabase, SqliteStore
from sandbox.saved_report import KernelReport, SavedState

pytestmark = pytest.mark.unit


def snapshot(owner: str, kind: str, size: int, session_id: str = "s-1") -> SnapshotRecord:
    return SnapshotRecord.model_validate(
        {
            "id": f"snap-{owner}{kind}{size}",
            "owner": owner,
            "kind": kind,
            "session_id": session_id,
            "backend": "local",
            "spec": SandboxSpec(),
            "bytes": size,
            "report": SavedState(),
        }
    )


async def test_records_outlive_the_store_object_and_filter_by_owner_and_state(
    tmp_path: Path,
) -> None:
    store = SqliteStore(SqliteDatabase(tmp_path))
    await store.put_session(
        SessionRecord(id="s-a", owner="o1", backend="local", spec=SandboxSpec())
    )
    paused = SessionRecord(id="s-b", owner="o1", backend="docker", spec=SandboxSpec())
    paused.state, paused.state_since = "paused", 10.0
    await store.put_session(paused)
    await store.put_session(
        SessionRecord(id="s-c", owner="o2", backend="local", spec=SandboxSpec())
    )
    store.database.close()
    again = SqliteStore(SqliteDatabase(tmp_path))  # a restarted service
    assert [r.id for r in await again.sessions(owner="o1", state="paused")] == ["s-b"]
    assert [r.id for r in await again.sessions(state="running", backend="local")] == ["s-a", "s-c"]
    assert [r.id for r in await again.sessions(state="paused", before=11.0)] == ["s-b"]
    assert await again.sessions(state="paused", before=9.0) == []
    assert await again.count_sessions("o1", "paused") == 1
    await again.delete_session("s-b")
    assert await again.get_session("s-b") is None
    assert oct((tmp_path / "state.db").stat().st_mode & 0o777) == "0o600"


async def test_usage_counts_named_snapshots_and_every_saved_byte(tmp_path: Path) -> None:
    store = SqliteStore(SqliteDatabase(tmp_path))
    for record in (
        snapshot("o1", "snapshot", 5),
        snapshot("o1", "paused", 7),
        snapshot("o2", "snapshot", 100),
    ):
        await store.put_snapshot(record)
        store.files_of(record.id).mkdir()
    assert await store.usage("o1") == (1, 12)
    assert await store.usage("nobody") == (0, 0)
    await store.delete_snapshot("snap-o1paused7")
    assert await store.usage("o1") == (1, 5)
    assert not store.files_of("snap-o1paused7").exists()


@pytest.mark.parametrize("bad", ["../x", "a/b", "snap-1/../../etc", ""])
def test_a_snapshot_id_is_never_a_path(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        SqliteStore(SqliteDatabase(tmp_path)).files_of(bad)


@pytest.mark.parametrize(
    "forged",
    [
        {"saved": "x" * 10},  # not a list
        {"saved": ["x" * 301]},  # a name past any real one
        {"saved": [str(i) for i in range(201)]},  # more names than a report lists
        {"unsaved": {"a": "why" * 200}},
        {"cwd": ["/etc"]},
        {"saved_count": -1},
    ],
)
def test_a_kernel_report_out_of_shape_is_refused(forged: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        KernelReport.model_validate(forged)


async def test_labels_never_bring_back_a_deleted_record_nor_undo_a_pause(
    tmp_path: Path,
) -> None:
    """As the Redis store's: labels set after the session ended elsewhere write nothing; set
    after a pause they leave the paused record as it is; a whole record written from an older
    copy of the session keeps the labels set since."""
    store = SqliteStore(SqliteDatabase(tmp_path))
    try:
        record = SessionRecord(id="s-a", owner="o1", backend="local", spec=SandboxSpec())
        await store.put_session(record)
        await store.put_session(record.model_copy(update={"state": "paused"}))
        assert await store.set_session_labels("s-a", {"e2b": "x", "k": "1"}) == {
            "e2b": "x",
            "k": "1",
        }
        assert await store.set_session_labels("s-a", {"k": None}) == {"e2b": "x"}
        found = await store.get_session("s-a")
        assert found is not None and (found.state, found.labels) == ("paused", {"e2b": "x"})
        await store.put_session(record)  # the older copy, without the labels
        found = await store.get_session("s-a")
        assert found is not None and (found.state, found.labels) == ("running", {"e2b": "x"})
        await store.delete_session("s-a")
        assert await store.set_session_labels("s-a", {"e2b": "y"}) is None
        assert await store.get_session("s-a") is None
    finally:
        store.database.close()


async def test_a_walk_over_the_running_sessions_goes_a_piece_at_a_time(tmp_path: Path) -> None:
    store = SqliteStore(SqliteDatabase(tmp_path))
    try:
        for i in range(7):
            record = SessionRecord(id=f"s-{i}", owner="o1", backend="local", spec=SandboxSpec())
            if i == 3:
                record.state = "paused"
            await store.put_session(record)
        seen: list[str] = []
        cursor, steps = 0, 0
        while True:
            cursor, records = await store.scan_sessions(cursor, 2)
            seen += [r.id for r in records]
            steps += 1
            if cursor == 0:
                break
        assert sorted(seen) == ["s-0", "s-1", "s-2", "s-4", "s-5", "s-6"] and steps > 1
        assert store.shared is False
    finally:
        store.database.close()


async def test_a_record_that_cannot_be_read_is_written_over(tmp_path: Path) -> None:
    """As the Redis store's: a whole record written over one that cannot be read (its labels
    with it) rather than failing."""
    store = SqliteStore(SqliteDatabase(tmp_path))
    try:
        record = SessionRecord(id="s-a", owner="o1", backend="local", spec=SandboxSpec())
        await store.put_session(record)
        await store.database.run(
            store._write_now, "UPDATE sessions SET doc = ? WHERE id = ?", ("{not json", "s-a")
        )
        await store.put_session(record.model_copy(update={"labels": {"k": "v"}}))
        found = await store.get_session("s-a")
        assert found is not None and found.labels == {"k": "v"}
    finally:
        store.database.close()
