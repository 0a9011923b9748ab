"""The E2B backend, driving E2B's SDK against our own front on 127.0.0.1: the real SDK over the
real wire, with no traffic leaving the machine. The front runs code in local sandboxes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from code_interpreter_wire.errors import FileMissing, InvalidPath, SandboxClosed
from code_interpreter_wire.results import ExecutionStatus, OutputEvent
from code_interpreter_wire.spec import SandboxSpec
from sandbox import Backend, create_backend
from sandbox.backends.e2b_sandbox import E2BSandbox
from sandbox.backends.registry import why_unavailable
from tests.e2b_sdk_fixtures import E2B_VARIABLES, stop_cleanly
from tests.orchestrator.service.conftest import KEY_A, Server, make_server


@pytest.fixture
def e2b_backend(e2b_server: Server, monkeypatch: pytest.MonkeyPatch) -> Backend:
    for name in E2B_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return create_backend("e2b", api_key=KEY_A, api_url=e2b_server.url, sandbox_url=e2b_server.url)


@pytest.fixture
async def remote(e2b_backend: Backend) -> AsyncIterator[E2BSandbox]:
    sandbox = await e2b_backend.create(SandboxSpec(default_timeout_s=60, env={"GIVEN": "at start"}))
    assert isinstance(sandbox, E2BSandbox)
    yield sandbox
    await sandbox.close()


def test_why_unavailable_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert "E2B API key" in (why_unavailable("e2b") or "")
    assert why_unavailable("e2b", api_key="k") is None


async def test_state_results_errors_and_events(remote: E2BSandbox) -> None:
    assert remote.backend == "e2b" and str(remote.workdir) == "/workspace"
    events: list[OutputEvent] = []

    async def sink(event: OutputEvent) -> None:
        events.append(event)

    first = await remote.execute("import os\nx = 41\nprint('hi')\nos.environ['GIVEN']")
    assert first.ok and first.stdout == "hi\n" and first.text == "at start"
    second = await remote.execute(
        "import sys\nprint('err', file=sys.stderr)\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2]); plt.show()\nx + 1",
        on_event=sink,
    )
    assert second.ok and second.text == "42" and second.stderr == "err\n"
    assert second.execution_count == first.execution_count + 1  # type: ignore[operator]
    assert [a.mime_type for a in second.artifacts] == ["image/png"]
    assert [e.type for e in events] == ["stderr", "result", "result"]
    failed = await remote.execute("1/0", on_event=sink)
    assert failed.status is ExecutionStatus.ERROR and failed.error is not None
    assert failed.error.name == "ZeroDivisionError" and "1/0" in failed.error.traceback
    assert events[-1].type == "error"
    streamed = [e.type async for e in remote.stream("print('s')\n7")]
    assert streamed == ["stdout", "result", "done"]


async def test_timeout_interrupt_and_restart(remote: E2BSandbox) -> None:
    await remote.execute("kept = 1")
    started = time.monotonic()
    timed = await remote.execute("import time\ntime.sleep(30)\nfinished = 1", timeout_s=1.5)
    assert timed.status is ExecutionStatus.TIMEOUT and timed.error is not None
    assert timed.error.name == "ExecutionTimeout" and time.monotonic() - started < 10
    after = await remote.execute("'finished' in globals(), kept")
    assert after.text == "(False, 1)"

    running = asyncio.ensure_future(remote.execute("import time\ntime.sleep(30)"))
    await asyncio.sleep(1.0)
    assert remote.is_busy and await remote.interrupt()
    cancelled = await running
    assert cancelled.status is ExecutionStatus.CANCELLED
    assert not await remote.interrupt()

    await remote.set_env({"LATER": "set"})
    scoped = await remote.execute(
        "import os; os.environ['LATER'], os.environ['ONCE'], os.getcwd()",
        env={"ONCE": "1"},
        cwd="sub",
    )
    assert scoped.error is not None  # sub does not exist yet
    await remote.upload("sub/x.txt", b"x")
    scoped = await remote.execute("import os; os.environ['LATER'], os.getcwd()", cwd="sub")
    assert scoped.text == "('set', '/home/user/sub')"
    assert (await remote.execute("import os; os.getcwd()")).text == "/home/user"

    await remote.restart()
    assert (await remote.execute("'kept' in globals()")).text == "False"


async def test_files(remote: E2BSandbox) -> None:
    info = await remote.upload("data/in.txt", b"hello")
    assert info.path == "data/in.txt" and info.size == 5
    await remote.execute("open('data/out.txt', 'w').write(open('data/in.txt').read() * 2)")
    assert await remote.download("data/out.txt") == b"hellohello"
    listing = await remote.list_files("data")
    assert [(f.path, f.type, f.size) for f in listing] == [
        ("data/in.txt", "file", 5),
        ("data/out.txt", "file", 10),
    ]
    assert {f.path for f in await remote.list_files(recursive=True)} >= {"data", "data/in.txt"}
    await remote.remove_file("data/in.txt")
    with pytest.raises(FileMissing):
        await remote.download("data/in.txt")
    with pytest.raises(InvalidPath):
        await remote.upload("../escape", b"x")
    from code_interpreter_wire.errors import FileTooLarge

    with pytest.raises(FileTooLarge):
        await remote.download("data/out.txt", max_bytes=4)


async def test_a_sandbox_killed_behind_its_back_is_closed(
    e2b_backend: Backend, e2b_server: Server
) -> None:
    sandbox = await e2b_backend.create()
    async with httpx.AsyncClient(base_url=e2b_server.url, headers={"X-API-Key": KEY_A}) as api:
        assert (await api.delete(f"/sandboxes/{sandbox.id}")).status_code == 204
    with pytest.raises(SandboxClosed):
        await sandbox.execute("1")
    await sandbox.close()
    with pytest.raises(SandboxClosed):
        await sandbox.execute("1")


@pytest.fixture(scope="module")
def chained(e2b_server: Server) -> Iterator[Server]:
    """A second service whose e2b backend is the first service's E2B front."""
    server = make_server(
        backends="local,e2b",
        pool_size=1,  # kept for local only: an idle E2B sandbox is billed
        host_tools='{"python": ["tests.orchestrator.host_tools.tools_for_tests:add"]}',
        e2b_api_key=KEY_A,
        e2b_api_url=e2b_server.url,
        e2b_sandbox_url=e2b_server.url,
    )
    for name in E2B_VARIABLES:
        server.env.pop(name, None)
    server.start()
    yield server
    stop_cleanly(server)


def test_the_orchestrator_uses_the_e2b_backend_like_any_other(chained: Server) -> None:
    with chained.client() as api:
        created = api.post("/v1/sessions", json={"backend": "e2b"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert list(api.get("/v1/status").json()["pools"]) == ["local"]  # never e2b
        with_tools = api.post("/v1/sessions", json={"backend": "e2b", "tools": ["add"]})
        assert with_tools.status_code == 400
        assert "cannot give sandboxed code host tools" in with_tools.text
        try:
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 5"})
            done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x * 2"}).json()
            assert done["status"] == "ok" and done["results"][0]["text"] == "10"
            timed = api.post(
                f"/v1/sessions/{sid}/execute",
                json={"code": "import time; time.sleep(20)", "timeout_s": 1},
            ).json()
            assert timed["status"] == "timeout"
            up = api.post(f"/v1/sessions/{sid}/files", files={"file": ("f.txt", b"abc")})
            assert up.status_code == 201, up.text
            assert api.get(f"/v1/sessions/{sid}/files/f.txt").content == b"abc"
        finally:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204


async def test_orphans_a_crash_left_are_killed(e2b_server: Server) -> None:
    def backend(orchestrator_id: str) -> Backend:
        return create_backend(
            "e2b",
            api_key=KEY_A,
            api_url=e2b_server.url,
            sandbox_url=e2b_server.url,
            orchestrator_id=orchestrator_id,
        )

    left = await backend("crashed").create()  # never closed: as if the service had crashed
    other = await backend("alive").create()
    try:
        assert await backend("crashed").cleanup_orphans() == 1
        with pytest.raises(SandboxClosed):
            await left.execute("1")
        assert (await other.execute("2")).text == "2"
    finally:
        await other.close()
        await left.close()
