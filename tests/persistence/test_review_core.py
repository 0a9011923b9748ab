"""Review of the persistence core: expiry with `idle_action=end`, what a crash leaves among the
saved states, and a snapshot deleted while a session is being started from it."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.config import Settings
from orchestrator.session_coordinator import LocalCoordinator
from orchestrator.sessions import Session, SessionManager
from sandbox import Backend
from sandbox.saved_state import StateTooLarge, save_state
from tests.conftest import small_spec
from tests.service.conftest import make_server, service_backends

pytestmark = pytest.mark.timeout(300)


def _start(api: httpx.Client, **fields: object) -> str:
    created = api.post("/v1/sessions", json={"backend": service_backends()[0], **fields})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_with_idle_action_end_an_expired_session_answers_410() -> None:
    """docs/persistence.md: `idle_action=end` restores the old behaviour (an expired session
    answers 410), even when the call comes before the reaper's round."""
    srv = make_server(idle_action="end", idle_timeout_s=2, reap_interval_s=3600).start()
    try:
        with srv.client() as api:
            sid = _start(api)
            time.sleep(3)
            late = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(1)"})
            assert late.status_code == 410, late.text
            assert "without activity" in late.text
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


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


def test_a_notice_not_yet_said_does_not_grow_with_each_pause_and_resume() -> None:
    """Paused and resumed again and again with no execution between (an agent listing files,
    an idle session woken by a look at it): the notice waiting to be said carried the last one
    whole inside the new one, so it grew by a copy at each round ("resumed: resumed: ...")."""
    srv = make_server().start()
    try:
        with srv.client() as api:
            sid = _start(api)
            built = api.post(
                f"/v1/sessions/{sid}/execute",
                json={"code": "x = 1; gen = (i for i in range(3))"},
            )
            assert built.status_code == 200, built.text
            notices = []
            for _ in range(4):
                assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
                resumed = api.post(f"/v1/sessions/{sid}/resume")
                assert resumed.status_code == 200, resumed.text
                notices.append(str(resumed.json()["notice"]))
            last = notices[-1]
            assert last.count("resumed") == 1, notices
            assert len(last) <= len(notices[0]) + 40, notices
            assert "gen (" in last and "1 variable(s)" in last, last
            said = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x)"}).json()
            assert said["stdout"].strip() == "1" and said["notice"].startswith(last), said
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


# A thread of the kernel's that keeps making and removing files while the state is saved.
_CHURN = """
import os, threading
os.makedirs('stable', exist_ok=True)
for i in range(400):
    open(f'stable/{i}', 'w').write('x' * 1000)
kept = 11
def churn():
    os.makedirs('churn', exist_ok=True)
    while True:
        for i in range(50):
            open(f'churn/{i}', 'w').write('y')
        for i in range(50):
            os.remove(f'churn/{i}')
threading.Thread(target=churn, daemon=True).start()
"""


async def test_files_that_come_and_go_while_the_state_is_saved_do_not_fail_it(
    backend: Backend, tmp_path: Path
) -> None:
    """An idle session whose code still writes temporary files (a thread, a process beside the
    kernel): a file listed, then removed before it is copied, failed the whole save, so the
    idle expiry ended the session (all lost) instead of pausing it."""
    sandbox = await backend.create(small_spec())
    try:
        started = await sandbox.execute(_CHURN)
        assert started.ok, started.error
        for attempt in range(3):
            saved = await save_state(sandbox, tmp_path / f"state{attempt}", max_bytes=50 << 20)
            assert saved.files >= 400 and "kept" in saved.saved
    finally:
        await sandbox.close()


async def test_a_saved_state_keeps_within_its_bytes_with_what_describes_its_files(
    backend: Backend, tmp_path: Path
) -> None:
    """The description of the files' modes, times and links is kept with the state: its bytes
    were left out of the state's size (so of the key's quota) and of its limit (up to 16 MB
    more for each snapshot or paused session)."""
    sandbox = await backend.create(small_spec())
    try:
        made = await sandbox.execute(
            "import os\nos.makedirs('many')\n"
            "for i in range(4000): open(f'many/{i:0200d}', 'w').close()"
        )
        assert made.ok, made.error
        # Room for it: the state's bytes are all it keeps (its report aside).
        saved = await save_state(sandbox, tmp_path / "state", max_bytes=5 << 20)
        on_disk = sum(p.stat().st_size for p in (tmp_path / "state").rglob("*") if p.is_file())
        on_disk -= (tmp_path / "state" / "state.json").stat().st_size
        assert saved.bytes == on_disk > 800_000, (saved.bytes, on_disk)
        # No room for it: refused, as files over the limit are.
        with pytest.raises(StateTooLarge):
            await save_state(sandbox, tmp_path / "small", max_bytes=600_000)
    finally:
        await sandbox.close()


async def test_a_session_used_while_the_reaper_pauses_others_is_not_paused(
    backend: Backend, tmp_path: Path
) -> None:
    """The reaper lists the sessions due, then pauses them one by one (seconds each, for a
    large state): one used meanwhile was paused all the same, in the middle of its user's
    work (its open connections and threads gone), because the list was not looked at again."""
    settings = Settings(
        state_dir=tmp_path,
        auth_disabled=True,
        backends=[backend.name],
        default_backend=backend.name,
        idle_timeout_s=60,
        reap_interval_s=3600,
    )
    expired: list[str] = []
    manager: SessionManager

    async def on_expiry(session: Session, why: str) -> None:
        expired.append(session.id)
        for other in manager.all():  # while this one is being paused, the other is used
            if other is not session:
                (await manager.get(other.id, other.owner)).touch()

    manager = SessionManager(
        settings,
        given_backends={backend.name: backend},
        on_expiry=on_expiry,
        coordinator=LocalCoordinator(),
    )
    await manager.start()
    try:
        first = await manager.create("owner", spec=small_spec())
        second = await manager.create("owner", spec=small_spec())
        for session in (first, second):
            session.last_active -= 120  # both idle past their expiry
        await manager.reap()
        assert expired == [first.id], expired
    finally:
        await manager.close()
