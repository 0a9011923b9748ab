"""The OpenAI Agents SDK's own E2B sandbox client, unmodified, on our E2B front: a `SandboxAgent`
driven by a scripted model runs a command; the session reads, writes and lists; its workspace is
persisted as a tar and hydrated into a new sandbox. Before the front served processes, the
session failed at its start (`test -d /workspace` is a command)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import Model, ModelResponse, RunConfig, Runner, Usage
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.items import TResponseInputItem, TResponseStreamEvent
from agents.run_config import SandboxRunConfig
from agents.sandbox import SandboxAgent
from agents.sandbox.errors import ExecTimeoutError
from agents.sandbox.session.sandbox_session import SandboxSession
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from tests.e2b_sdk_fixtures import e2b_env, e2b_server, template
from tests.orchestrator.service.conftest import Server

__all__ = ["e2b_env", "e2b_server", "template"]  # the fixtures, used here by name


class ShellModel(Model):
    """Calls the sandbox's `exec_command` tool once with `arguments`, then answers; keeps what
    it was given."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments
        self.inputs: list[Any] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        *_: Any,
        **__: Any,
    ) -> ModelResponse:
        self.inputs.append(input)
        output: list[Any]
        if len(self.inputs) == 1:
            output = [
                ResponseFunctionToolCall(
                    type="function_call",
                    id="fc-1",
                    call_id="call-1",
                    name="exec_command",
                    arguments=json.dumps(self.arguments),
                    status="completed",
                )
            ]
        else:
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            output = [
                ResponseOutputMessage(
                    type="message", id="msg", role="assistant", status="completed", content=[text]
                )
            ]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the test runs the agent without streaming")


def options(template: str) -> E2BSandboxClientOptions:
    # The client's defaults ask for internet access and pausing, which sandboxes here do not
    # have: the control plane refuses them with the reason, so a user passes these.
    return E2BSandboxClientOptions(
        sandbox_type="e2b", template=template, allow_internet_access=False, on_timeout="kill"
    )


@pytest.fixture
async def session(e2b_env: object, template: str) -> AsyncIterator[SandboxSession]:
    client = E2BSandboxClient()
    made = await client.create(options=options(template))
    await made.start()
    try:
        yield made
    finally:
        await made.shutdown()
        await client.delete(made)


async def test_a_sandbox_agent_runs_a_command(session: SandboxSession) -> None:
    command = {"cmd": "echo from-the-model > made.txt && cat made.txt && python3 -c 'print(6*7)'"}
    model = ShellModel(command)
    agent = SandboxAgent(name="worker", instructions="Use the shell.", model=model)
    run = RunConfig(tracing_disabled=True, sandbox=SandboxRunConfig(session=session))
    result = await Runner.run(agent, "make a file", run_config=run)
    assert result.final_output == "done"
    tool_output = json.dumps([str(item) for item in model.inputs[-1]])
    assert "from-the-model" in tool_output and "42" in tool_output
    assert (await session.read(Path("made.txt"))).read() == b"from-the-model\n"


async def test_read_write_ls_persist_and_hydrate(session: SandboxSession, template: str) -> None:
    await session.write(Path("data/table.csv"), io.BytesIO(b"a,b\n1,2\n"))
    assert (await session.read(Path("/workspace/data/table.csv"))).read() == b"a,b\n1,2\n"
    listed = await session.ls(Path("data"))
    assert [Path(entry.path).name for entry in listed] == ["table.csv"]
    done = await session.exec("wc", "-l", "data/table.csv")
    assert done.exit_code == 0 and done.stdout.decode().startswith("2")

    archive = (await session.persist_workspace()).read()
    client = E2BSandboxClient()
    other = await client.create(options=options(template))
    await other.start()
    try:
        await other.hydrate_workspace(io.BytesIO(archive))
        assert (await other.read(Path("data/table.csv"))).read() == b"a,b\n1,2\n"
    finally:
        await other.shutdown()
        await client.delete(other)


async def test_a_command_past_its_timeout_is_the_sdks_exec_timeout(session: SandboxSession) -> None:
    """Killed at its time limit, a command ends its E2B stream as envd's does past a deadline:
    the SDK raises ExecTimeoutError (before, whichever clock ran out first decided, and the
    front's usually did: a command that exited -1 with no output)."""
    with pytest.raises(ExecTimeoutError):
        await session.exec("echo started; sleep 30; echo finished > finished.txt", timeout=1)
    # It was killed, not left running: no `sleep 30` among the sandbox's processes.
    scan = (
        "import os\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try: argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')[:2]\n"
        "    except OSError: continue\n"
        "    print(argv)"
    )
    # The SDK's clock may run out just before the server's kills it: looked at until it has.
    for _ in range(60):
        listed = await session.exec("python3", "-c", scan)
        assert listed.exit_code == 0, listed
        assert b"[b'python3', b'-c']" in listed.stdout  # the scan saw itself: it reads /proc
        if b"[b'sleep', b'30']" not in listed.stdout:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError("the command outlived its time limit")


async def test_the_clients_defaults_run_exec_read_write_and_expose_a_port(
    e2b_env: Server, template: str
) -> None:
    """Nothing but the template and a port to expose: internet access, pause on timeout and
    auto-resume as the client asks by default; the exposed port serves through the service."""
    client = E2BSandboxClient()
    made = await client.create(
        options=E2BSandboxClientOptions(
            sandbox_type="e2b", template=template, exposed_ports=(8000,)
        )
    )
    await made.start()
    try:
        await made.write(Path("site/index.html"), io.BytesIO(b"<p>from the agent</p>"))
        assert (await made.read(Path("site/index.html"))).read() == b"<p>from the agent</p>"
        done = await made.exec("cat", "site/index.html")
        assert done.exit_code == 0 and done.stdout == b"<p>from the agent</p>"
        model = ShellModel({"cmd": "wc -c < site/index.html"})
        agent = SandboxAgent(name="worker", instructions="Use the shell.", model=model)
        run = RunConfig(tracing_disabled=True, sandbox=SandboxRunConfig(session=made))
        assert (await Runner.run(agent, "measure it", run_config=run)).final_output == "done"
        assert "21" in json.dumps([str(item) for item in model.inputs[-1]])
        ran = await made.exec(
            "python3",
            "-c",
            "import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-m', 'http.server', '8000', '-d', 'site'],"
            " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
        )
        assert ran.exit_code == 0, ran
        endpoint = await made.resolve_exposed_port(8000)
        assert endpoint.host.startswith("8000-") and not endpoint.tls
        host = f"{endpoint.host}:{endpoint.port}"
        async with httpx.AsyncClient(base_url=e2b_env.url, timeout=60) as web:
            for _ in range(300):  # until the server started in the background answers
                page = await web.get("/", headers={"Host": host})
                if page.status_code == 200:
                    break
                await asyncio.sleep(0.2)
        assert page.status_code == 200 and page.text == "<p>from the agent</p>"
    finally:
        await made.shutdown()
        await client.delete(made)
