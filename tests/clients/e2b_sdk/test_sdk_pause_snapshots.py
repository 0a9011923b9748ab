"""E2B's pause, connect (resume), lifecycle auto-pause and snapshots, with E2B's unmodified SDK
against a real server, on each backend; and a paused sandbox found whole after a SIGKILL."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import (
    NotFoundException,
    SandboxException,
    SandboxQuery,
    SandboxState,
    ServiceBusyException,
    TimeoutException,
)
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import KEY_B, Server, leftovers, make_server

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """No warm pool: every sandbox the server holds is one a test made."""
    srv = make_server(reap_interval_s=1).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, server: Server) -> Server:
    point_sdk_at(monkeypatch, server.url)
    return server


def saved_states(server: Server) -> list[str]:
    where = server.state_dir / "snapshots"
    return sorted(p.name for p in where.iterdir()) if where.is_dir() else []


def listed(state: SandboxState | None = None, **opts: object) -> dict[str, SandboxState]:
    query = SandboxQuery(state=[state]) if state is not None else None
    paginator = Sandbox.list(query=query, **opts)  # type: ignore[arg-type]
    found = {}
    while paginator.has_next:
        found.update({x.sandbox_id: x.state for x in paginator.next_items()})
    return found


def wait_for(check: Callable[[], bool], what: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting until {what}")


def test_pause_holds_nothing_and_connect_brings_everything_back(sdk: Server, template: str) -> None:
    sbx = Sandbox.create(template=template, metadata={"who": "pause"})
    sid = sbx.sandbox_id
    sbx.run_code("x = 41")
    sbx.files.write("kept.txt", "hello")
    context = sbx.create_code_context()
    sbx.run_code("y = 'in a context'", context=context)

    assert sbx.pause() is True
    assert leftovers(sdk) == [], "a paused sandbox (or one of its contexts) still holds a sandbox"
    assert Sandbox.pause(sid) is False  # E2B's 409: already paused
    assert sbx.get_info().state == SandboxState.PAUSED
    assert listed(SandboxState.PAUSED) == {sid: SandboxState.PAUSED}
    assert sid not in listed(SandboxState.RUNNING)
    assert listed()[sid] == SandboxState.PAUSED  # no state asked: both
    with pytest.raises(TimeoutException, match="was not found"):  # E2B: a paused one is gone
        sbx.run_code("x")
    assert leftovers(sdk) == []  # looking at it, or knocking, did not wake it
    with pytest.raises(SandboxException, match="on_resume"):
        Sandbox.connect(sid, on_resume="reboot")  # a cold boot is not offered: said, not ignored
    with pytest.raises(SandboxException, match="is paused: connect"):
        Sandbox.set_timeout(sid, 60)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=KEY_B)
    assert Sandbox.kill(sid, api_key=KEY_B) is False
    with pytest.raises(NotFoundException):
        Sandbox.pause("s-nothing-here")

    back = Sandbox.connect(sid)
    assert back.run_code("x + 1").text == "42"
    assert back.files.read("kept.txt") == "hello"
    assert back.run_code("y", context=context).text == "in a context"
    info = back.get_info()
    assert info.state == SandboxState.RUNNING and info.metadata == {"who": "pause"}
    left = info.end_at.timestamp() - time.time()
    assert 200 < left <= 301, f"the resume did not arm E2B's default 300 s timeout ({left} s)"
    assert sbx.run_code("x").text == "41"  # the old handle's token still opens it
    assert back.connect() is not None  # running: connecting again changes nothing
    back.kill()


def test_what_a_resume_could_not_bring_back_is_said(sdk: Server, template: str) -> None:
    """docs/e2b.md: what could not be saved is named in the next execution's notice. E2B's
    stream has no notice field: it comes as that execution's stderr, once."""
    sbx = Sandbox.create(template=template)
    sbx.run_code("kept = 1\nrunning = (i for i in range(3))")
    assert sbx.pause() is True
    back = Sandbox.connect(sbx.sandbox_id)
    first = back.run_code("kept")
    assert first.text == "1", first
    told = "".join(first.logs.stderr)
    assert "running" in told and "not saved" in told, first.logs
    again = back.run_code("kept")
    assert again.logs.stderr == [], again.logs  # said once
    back.kill()


def test_a_sandbox_running_code_is_not_paused(sdk: Server) -> None:
    sbx = Sandbox.create()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sbx.run_code, "import time\ntime.sleep(4)\ndone = 1")
        wait_for(lambda: _busy(sdk, sbx.sandbox_id), "the code started")
        with pytest.raises(ServiceBusyException, match="running code"):
            sbx.pause()  # not E2B's 409, which the SDK would read as "already paused"
        assert running.result().error is None
    assert sbx.get_info().state == SandboxState.RUNNING
    assert sbx.pause() is True
    sbx.kill()


def _busy(server: Server, sandbox_id: str) -> bool:
    with server.client() as api:
        return bool(api.get(f"/v1/sessions/{sandbox_id}").json()["busy"])


def test_killing_a_paused_sandbox_deletes_its_state(sdk: Server, template: str) -> None:
    before = saved_states(sdk)
    sbx = Sandbox.create(template=template)
    sbx.run_code("big = list(range(1000))")
    assert sbx.pause() is True
    assert len(saved_states(sdk)) == len(before) + 1
    assert sbx.kill() is True
    assert saved_states(sdk) == before
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    assert sbx.sandbox_id not in listed()


def test_a_snapshot_starts_new_sandboxes_for_its_key_only(sdk: Server, template: str) -> None:
    sbx = Sandbox.create(template=template)
    sbx.run_code("import pandas as pd\ndf = pd.DataFrame({'a': range(10)})\nn = 7")
    sbx.files.write("data.txt", "prepared")
    snap = sbx.create_snapshot(name="prepared")
    assert snap.names == ["prepared"]
    assert sbx.run_code("n").text == "7"  # the source runs on
    assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [snap.snapshot_id]
    assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]

    fork = Sandbox.create(snap.snapshot_id)
    assert fork.sandbox_id != sbx.sandbox_id
    assert fork.run_code("int(df['a'].sum()) + n").text == "52"
    assert fork.files.read("data.txt") == "prepared"
    fork.kill()
    sbx.kill()

    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(snap.snapshot_id, api_key=KEY_B)
    assert Sandbox.list_snapshots(api_key=KEY_B).next_items() == []
    assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=KEY_B) is False
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(snap.snapshot_id)
    other = Sandbox.create(template=template)
    with pytest.raises(SandboxException, match="filesystem-only snapshot"):
        other.create_snapshot(mode="filesystem")  # said, not done otherwise
    other.kill()


def test_lifecycle_pause_on_timeout(sdk: Server, template: str) -> None:
    sbx = Sandbox.create(template=template, timeout=3, lifecycle={"on_timeout": "pause"})
    assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
    sbx.run_code("x = 5")
    wait_for(lambda: sbx.get_info().state == SandboxState.PAUSED, "E2B's timeout paused it")
    assert leftovers(sdk) == []
    assert Sandbox.connect(sbx.sandbox_id, timeout=60).run_code("x").text == "5"
    sbx.kill()

    woken = Sandbox.create(
        template=template, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True}
    )
    woken.run_code("z = 9")
    wait_for(lambda: woken.get_info().state == SandboxState.PAUSED, "E2B's timeout paused it")
    assert woken.run_code("z").text == "9"  # auto-resume: traffic wakes it
    assert woken.get_info().state == SandboxState.RUNNING
    woken.kill()

    with pytest.raises(SandboxException, match="filesystem"):
        Sandbox.create(
            template=template, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
        )


def test_woken_through_another_door_its_timeout_starts_again(sdk: Server) -> None:
    sbx = Sandbox.create(timeout=3)
    sbx.run_code("w = 1")
    assert sbx.pause() is True
    time.sleep(4)  # past its timeout while paused: a paused sandbox's timeout does not run
    with sdk.client() as api:  # the sessions API wakes it on its next call
        done = api.post(f"/v1/sessions/{sbx.sandbox_id}/execute", json={"code": "print(w)"})
        assert done.json()["stdout"] == "1\n"
    time.sleep(2.5)  # two sweeps: not killed for the timeout it passed while paused
    assert sbx.get_info().state == SandboxState.RUNNING
    sbx.kill()


def test_without_lifecycle_the_timeout_still_kills(sdk: Server) -> None:
    sbx = Sandbox.create(timeout=2)
    wait_for(lambda: sbx.sandbox_id not in listed(), "E2B's timeout killed it")
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_list_pages_with_next_token(sdk: Server) -> None:
    made = [Sandbox.create() for _ in range(3)]
    paginator = Sandbox.list(limit=2)
    first = paginator.next_items()
    assert len(first) == 2 and paginator.has_next
    seen = [x.sandbox_id for x in first]
    while paginator.has_next:
        seen += [x.sandbox_id for x in paginator.next_items()]
    assert len(seen) == len(set(seen)) and {s.sandbox_id for s in made} <= set(seen)
    newest_first = [x.sandbox_id for x in Sandbox.list(order="desc").next_items()]
    assert newest_first[: len(made)] == [s.sandbox_id for s in reversed(made)]
    for sandbox in made:
        sandbox.kill()


async def test_async_pause_and_connect(sdk: Server) -> None:
    sbx = await AsyncSandbox.create()
    await sbx.run_code("a = 'async'")
    assert await sbx.pause() is True
    assert (await sbx.get_info()).state == SandboxState.PAUSED
    back = await AsyncSandbox.connect(sbx.sandbox_id)
    assert (await back.run_code("a")).text == "async"
    # The async SDK's older name for the same call.
    assert await back.beta_pause() is True
    again = await AsyncSandbox.connect(sbx.sandbox_id)
    assert (await again.run_code("a")).text == "async"
    await again.kill()


def test_a_paused_sandbox_survives_a_sigkill(
    monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    srv = make_server(reap_interval_s=1).start()
    try:
        point_sdk_at(monkeypatch, srv.url)
        sbx = Sandbox.create(
            template=template, metadata={"kept": "yes"}, lifecycle={"on_timeout": "pause"}
        )
        sbx.run_code("x = 'before the crash'")
        sbx.files.write("f.txt", "file")
        assert sbx.pause() is True
        running = Sandbox.create(template=template)  # running at the crash
        running.files.write("g.txt", "salvaged")
        srv.stop(signal.SIGKILL)
        srv.start()
        assert listed(SandboxState.PAUSED) == {
            sbx.sandbox_id: SandboxState.PAUSED,
            running.sandbox_id: SandboxState.PAUSED,
        }
        # What the service paused itself is woken by its traffic, as if never paused.
        assert running.files.read("g.txt") == "salvaged"
        assert running.get_info().state == SandboxState.RUNNING
        running.kill()
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.metadata == {"kept": "yes"}
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": False}
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=KEY_B)
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.run_code("x").text == "before the crash"
        assert sbx.files.read("f.txt") == "file"  # the token given before the crash opens it
        back.kill()
        assert leftovers(srv) == []
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
