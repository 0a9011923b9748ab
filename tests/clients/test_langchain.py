"""The LangChain tool, invoked as a model's ToolCall; the ToolMessage is what we read."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.messages.tool import ToolCall

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.langchain import CodeInterpreterTool
from code_interpreter_wire.results import Execution, ExecutionStatus
from tests.orchestrator.service.conftest import KEY_A, Server, make_server

PLOT = "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [2, 5])\nplt.show()\nprint('plotted')"


def call(code: object, call_id: str = "call-1", **extra: object) -> ToolCall:
    args = {"code": code} if code is not None else {}
    return ToolCall(name="code_interpreter", args={**args, **extra}, id=call_id, type="tool_call")


async def test_async_call_gives_text_to_the_model_and_the_execution_as_artifact(
    code_session: CodeSession,
) -> None:
    tool = CodeInterpreterTool(session=code_session)

    message = await tool.ainvoke(call(PLOT))

    assert isinstance(message, ToolMessage) and message.tool_call_id == "call-1"
    assert "plotted" in message.content and "[images] 1: image/png" in message.content
    assert "base64" not in message.content  # the image stays out of the model's context
    execution = message.artifact
    assert isinstance(execution, Execution) and execution.status is ExecutionStatus.OK
    [image] = execution.artifacts
    assert image.mime_type == "image/png" and image.data.startswith(b"\x89PNG")


def test_sync_call_shares_the_session_with_async_calls(code_session: CodeSession) -> None:
    tool = CodeInterpreterTool(session=code_session)
    asyncio.run(tool.ainvoke(call("answer = 40")))  # another event loop, the same kernel

    message = tool.invoke(call("answer + 2", call_id="call-2"))

    assert message.tool_call_id == "call-2"
    assert "[result]\n42" in message.content
    assert message.artifact.results[0].text == "42"


def test_errors_reach_the_model_as_tool_output(code_session: CodeSession) -> None:
    tool = CodeInterpreterTool(session=code_session)

    failed = tool.invoke(call("1 / 0"))
    assert "ZeroDivisionError" in failed.content
    assert failed.artifact.error.name == "ZeroDivisionError"

    malformed = tool.invoke(call(None, cod="1 + 1"))
    assert malformed.status == "error" and malformed.artifact is None
    assert "'code' is missing" in malformed.content

    empty = tool.invoke(call(""))
    assert "'code' is empty" in empty.content


def test_a_sandbox_that_cannot_start_is_reported() -> None:
    broken = CodeSession.embedded("local", bwrap="/nonexistent/bwrap")
    tool = CodeInterpreterTool(session=broken)

    message = tool.invoke(call("1 + 1"))

    assert message.status == "error"
    assert "the sandbox failed" in message.content and "bwrap" in message.content


@pytest.fixture(scope="module")
def service() -> Iterator[Server]:
    srv = make_server().start()
    yield srv
    srv.stop()
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


async def test_a_remote_session_lives_in_the_service(service: Server) -> None:
    with service.client() as api:
        before = {s["id"] for s in api.get("/v1/sessions").json()}
        remote = CodeSession.remote(service.url, KEY_A)
        tool = CodeInterpreterTool(session=remote)
        await tool.ainvoke(call("total = 40"))
        message = tool.invoke(call("total + 2"))
        assert "[result]\n42" in message.content and message.artifact.results[0].text == "42"
        [created] = {s["id"] for s in api.get("/v1/sessions").json()} - before
        assert remote.session_id == created

        # Another CodeSession may join that session by id; closing it leaves the session alone.
        async with CodeSession.remote(service.url, KEY_A, session_id=created) as joined:
            assert (await joined.execute("total")).text == "40"
        assert api.get(f"/v1/sessions/{created}").status_code == 200
        await remote.close()  # the session this object made ends with it
        assert api.get(f"/v1/sessions/{created}").status_code == 410

    wrong = CodeInterpreterTool(session=CodeSession.remote(service.url, KEY_A, "s-missing"))
    failed = wrong.invoke(call("1"))
    assert failed.status == "error" and "404" in failed.content


def test_the_default_session_is_closed_when_the_process_exits(state_dir: Path) -> None:
    # XDG_RUNTIME_DIR moves the embedded session's state directory to one of the test's own.
    script = (
        "from code_interpreter_client.langchain import CodeInterpreterTool\n"
        "print(CodeInterpreterTool().invoke({'code': '6 * 7'}))\n"
    )
    # TMPDIR: where the session's in-process service keeps its own state, also the test's.
    service_tmp = state_dir.parent / "tmp"
    service_tmp.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(state_dir.parent), "TMPDIR": str(service_tmp)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[result]\n42" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    sessions = state_dir.parent / "code-interpreter" / "local"
    assert list(sessions.iterdir()) == []  # the workspace and its directory are gone
    # And the service's state dir: only the per-user directory it was made in is left, empty.
    assert [p.name for p in service_tmp.iterdir()] == [f"code-interpreter-embedded-{os.getuid()}"]
    assert list((service_tmp / f"code-interpreter-embedded-{os.getuid()}").iterdir()) == []
