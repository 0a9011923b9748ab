"""E2B's `AsyncSandbox`, unmodified, against our front; and the front under `/e2b`, and for
E2B_DEBUG clients (which skip the control plane and send no credentials)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at, stop_cleanly
from tests.orchestrator.service.conftest import Server, make_server


@pytest.fixture
async def asbx(e2b_env: Server, template: str) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(template=template)
    yield sandbox
    await sandbox.kill()


async def test_async_state_callbacks_and_errors(asbx: AsyncSandbox) -> None:
    seen: list[str] = []

    async def on_stdout(message: object) -> None:
        seen.append(f"out:{message}")

    def on_result(result: object) -> None:  # plain callables are fine too
        seen.append(f"result:{result}")

    await asbx.run_code("total = 40")
    execution = await asbx.run_code(
        "print('working')\ntotal + 2", on_stdout=on_stdout, on_result=on_result
    )
    assert execution.text == "42" and seen == ["out:working\n", "result:Result(42)"]
    failed = await asbx.run_code("undefined_name")
    assert failed.error is not None and failed.error.name == "NameError"


async def test_async_timeout_interrupts_and_executions_queue(asbx: AsyncSandbox) -> None:
    with pytest.raises(TimeoutException):
        await asbx.run_code("import time\ntime.sleep(30)\nfinished = True", timeout=1.5)
    # A second execution sent while one runs waits for it.
    running = asyncio.ensure_future(asbx.run_code("import time; time.sleep(1); order = ['first']"))
    await asyncio.sleep(0.4)
    second = await asbx.run_code("order.append('second'); order, 'finished' in globals()")
    assert (await running).error is None and second.text == "(['first', 'second'], False)"


async def test_async_contexts_env_and_files(asbx: AsyncSandbox) -> None:
    context = await asbx.create_code_context(cwd="/tmp")
    assert context.cwd == "/tmp"
    assert (await asbx.run_code("import os; os.getcwd()", context=context)).text == "/tmp"
    assert (await asbx.run_code("import os; os.getcwd()")).text == "/home/user"
    await asbx.remove_code_context(context.id)
    code = "import os; os.environ['ONLY_NOW']"
    assert (await asbx.run_code(code, envs={"ONLY_NOW": "1"})).text == "1"
    await asbx.files.write("notes/a.txt", "from the SDK")
    await asbx.run_code("open('notes/b.txt', 'w').write(open('notes/a.txt').read().upper())")
    assert await asbx.files.read("notes/b.txt") == "FROM THE SDK"
    assert sorted(e.name for e in await asbx.files.list("notes")) == ["a.txt", "b.txt"]
    await asbx.files.remove("notes")
    assert not await asbx.files.exists("notes/a.txt")


async def test_async_list_and_kill(asbx: AsyncSandbox) -> None:
    paginator = AsyncSandbox.list()
    assert asbx.sandbox_id in [s.sandbox_id for s in await paginator.next_items()]
    info = await asbx.get_info()
    assert info.sandbox_id == asbx.sandbox_id
    await asbx.set_timeout(30)
    assert await asbx.kill()
    assert not await asbx.is_running()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(asbx.sandbox_id)


def test_the_front_under_the_e2b_prefix(
    monkeypatch: pytest.MonkeyPatch, e2b_server: Server
) -> None:
    point_sdk_at(monkeypatch, f"{e2b_server.url}/e2b")
    sandbox = Sandbox.create()
    try:
        assert sandbox.run_code("n = 6; n * 7").text == "42"
        sandbox.files.write("/workspace/p.txt", "prefixed")
        assert [e.name for e in sandbox.files.list("/workspace")] == ["p.txt"]
        assert sandbox.files.read("p.txt") == "prefixed"
        context = sandbox.create_code_context()
        assert sandbox.run_code("'n' in globals()", context=context).text == "False"
        assert sandbox.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    finally:
        assert sandbox.kill()
    assert not sandbox.is_running()


@pytest.fixture(scope="module")
def open_server() -> Iterator[Server]:
    """A server with auth disabled: the only kind that serves E2B_DEBUG clients."""
    server = make_server(auth_disabled="true", backends="local", default_backend="local")
    server.start()
    yield server
    stop_cleanly(server)


def test_e2b_debug_reaches_one_sandbox_without_credentials(
    monkeypatch: pytest.MonkeyPatch, open_server: Server
) -> None:
    point_sdk_at(monkeypatch, open_server.url, key=None)
    monkeypatch.setenv("E2B_DEBUG", "true")
    first = Sandbox.create()  # the SDK makes no API call in debug mode
    assert first.sandbox_id == "debug_sandbox_id"
    first.run_code("kept = 'across clients'")
    first.files.write("debug.txt", "ok")
    second = Sandbox.create()
    assert second.run_code("kept, open('debug.txt').read()").text == "('across clients', 'ok')"


def test_e2b_debug_is_refused_by_a_server_with_keys(
    monkeypatch: pytest.MonkeyPatch, e2b_server: Server
) -> None:
    point_sdk_at(monkeypatch, e2b_server.url, key=None)
    monkeypatch.setenv("E2B_DEBUG", "true")
    sandbox = Sandbox.create()
    started = time.monotonic()
    with pytest.raises(TimeoutException, match="was not found"):
        sandbox.run_code("1")
    assert time.monotonic() - started < 30
