"""The store of session records and saved states (SQLite under the state dir), and the checks on
what a kernel reports of its own state."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.state_store import SessionRecord, SnapshotRecord, SqliteStore
from sandbox.saved_state import KernelReport, SavedState
from sandbox.spec import SandboxSpec


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


def test_records_outlive_the_store_object_and_filter_by_owner_and_state(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    store.put_session(SessionRecord(id="s-a", owner="o1", backend="local", spec=SandboxSpec()))
    paused = SessionRecord(id="s-b", owner="o1", backend="docker", spec=SandboxSpec())
    paused.state, paused.state_since = "paused", 10.0
    store.put_session(paused)
    store.put_session(SessionRecord(id="s-c", owner="o2", backend="local", spec=SandboxSpec()))
    store.close()
    again = SqliteStore(tmp_path)  # a restarted service
    assert [r.id for r in again.sessions(owner="o1", state="paused")] == ["s-b"]
    assert [r.id for r in again.sessions(state="running", backend="local")] == ["s-a", "s-c"]
    assert [r.id for r in again.sessions(state="paused", before=11.0)] == ["s-b"]
    assert again.sessions(state="paused", before=9.0) == []
    assert again.count_sessions("o1", "paused") == 1
    again.delete_session("s-b")
    assert again.get_session("s-b") is None
    assert oct((tmp_path / "state.db").stat().st_mode & 0o777) == "0o600"


def test_usage_counts_named_snapshots_and_every_saved_byte(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    for record in (
        snapshot("o1", "snapshot", 5),
        snapshot("o1", "paused", 7),
        snapshot("o2", "snapshot", 100),
    ):
        store.put_snapshot(record)
        store.files_of(record.id).mkdir()
    assert store.usage("o1") == (1, 12)
    assert store.usage("nobody") == (0, 0)
    store.delete_snapshot("snap-o1paused7")
    assert store.usage("o1") == (1, 5)
    assert not store.files_of("snap-o1paused7").exists()


@pytest.mark.parametrize("bad", ["../x", "a/b", "snap-1/../../etc", ""])
def test_a_snapshot_id_is_never_a_path(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        SqliteStore(tmp_path).files_of(bad)


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
