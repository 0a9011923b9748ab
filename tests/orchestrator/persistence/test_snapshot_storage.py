"""A saved state's files on disk: what a crash left half-written is removed at the next start,
and a snapshot is not deleted from under a session being started from it."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.service.conftest import make_server, service_backends

pytestmark = pytest.mark.timeout(300)


def _start(api: httpx.Client, **fields: object) -> str:
    created = api.post("/v1/sessions", json={"backend": service_backends()[0], **fields})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_saved_state_files_no_record_names_are_removed_at_start() -> None:
    """A crash (SIGKILL) in the middle of a save leaves a saved state's directory that no row
    names; nothing else ever removes it, nor counts it in a quota: the next start does."""
    srv = make_server().start()
    try:
        with srv.client() as api:
            sid = _start(api)
            done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "kept = 1"})
            assert done.status_code == 200, done.text
            snap = api.post(f"/v1/sessions/{sid}/snapshots", json={"name": "k"})
            assert snap.status_code == 201, snap.text
        srv.stop()
        # What a save cut short by a SIGKILL leaves: files under a new id, no row.
        half = srv.state_dir / "snapshots" / "snap-0123456789abcdef01234567"
        (half / "files").mkdir(parents=True)
        (half / "namespace.dill").write_bytes(bytes(1 << 20))
        srv.start()
        with srv.client() as api:
            assert not half.exists(), "a half-written saved state outlived the restart"
            kept = snap.json()["id"]
            assert (srv.state_dir / "snapshots" / kept).is_dir()  # a recorded one stays
            back = api.post("/v1/sessions", json={"snapshot_id": kept})
            assert back.status_code == 201, back.text
            out = api.post(
                f"/v1/sessions/{back.json()['id']}/execute", json={"code": "print(kept)"}
            )
            assert out.json()["stdout"].strip() == "1"
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


# A variable whose loading waits until a file named `release` appears in the workspace: a
# session started from a snapshot holding it stays in its restore until the test says so.
_GATE = """
import os, time
def _wait_for_release(path=os.path.join(os.getcwd(), "release")):
    import os, time  # loaded before the namespace's own modules are
    while not os.path.exists(path):
        time.sleep(0.02)
    return "released"
class _Gate:
    def __reduce__(self):
        return (_wait_for_release, ())
gate = _Gate()
kept = 5
"""


def _workspaces(state_dir: Path) -> set[Path]:
    return set(state_dir.glob("*/*/workspace"))


def test_a_snapshot_is_not_deleted_from_under_a_fork_starting_from_it() -> None:
    """The fork finds the snapshot, then makes its sandbox (seconds), then restores it: a DELETE
    meanwhile took its files away (a 500, the fork lost). It is refused (409) until the fork
    has what it needs; then it succeeds. The fork is held inside its restore by the test (a
    variable whose loading waits for a file the test writes), so the DELETE surely comes while
    the fork runs."""
    srv = make_server(pool_size=0).start()
    try:
        with srv.client() as api:
            sid = _start(api)
            built = api.post(f"/v1/sessions/{sid}/execute", json={"code": _GATE})
            assert built.status_code == 200, built.text
            snap = api.post(f"/v1/sessions/{sid}/snapshots", json={}).json()["id"]
            before = _workspaces(srv.state_dir)
            forked: list[httpx.Response] = []

            def fork() -> None:
                with srv.client() as own:
                    forked.append(own.post("/v1/sessions", json={"snapshot_id": snap}))

            forking = threading.Thread(target=fork)
            forking.start()
            deadline = time.monotonic() + 120
            while not (_workspaces(srv.state_dir) - before) and time.monotonic() < deadline:
                time.sleep(0.05)  # the fork's sandbox appears: from here its restore waits
            new = _workspaces(srv.state_dir) - before
            assert len(new) == 1, new
            early = api.delete(f"/v1/snapshots/{snap}")
            (new.pop() / "release").touch()
            forking.join(timeout=120)
            assert forked and forked[0].status_code == 201, forked and forked[0].text
            assert early.status_code == 409, early.text
            assert "being started" in early.text
            fork_id = forked[0].json()["id"]
            out = api.post(f"/v1/sessions/{fork_id}/execute", json={"code": "print(kept, gate)"})
            assert out.json()["stdout"].strip() == "5 released", out.text
            assert api.delete(f"/v1/snapshots/{snap}").status_code == 204
            assert not (srv.state_dir / "snapshots" / snap).exists()
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
