"""Our own provider for the OpenAI Agents SDK's sandbox interface: a real `SandboxAgent`, driven by
the SDK's Runner and a scripted model (no network), runs in our sandboxes, embedded in this
process and through a running service: commands, files, a terminal exchange, and a workspace
persisted at the end of one run and hydrated into a new session for the next.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import Model, ModelResponse, ModelSettings, RunConfig, Runner, Usage
from agents.items import TResponseInputItem, TResponseStreamEvent
from agents.run_config import SandboxRunConfig
from agents.sandbox import SandboxAgent
from agents.sandbox.capabilities import Filesystem, Shell
from agents.sandbox.errors import ExecTimeoutError, WorkspaceReadNotFoundError
from agents.sandbox.snapshot import LocalSnapshotSpec
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from code_interpreter_client.agents_sandbox import (
    CodeInterpreterSandboxClient,
    CodeInterpreterSandboxClientOptions,
    CodeInterpreterSandboxSession,
)
from code_interpreter_client.agents_sandbox.terminals import TERMINAL_BUFFER_BYTES, Terminal
from code_interpreter_client.code_session import CodeSession
from code_interpreter_wire.processes import ProcessRequest
from tests.conftest import backend_config, small_spec
from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)

# A tool call as the model makes it: (tool, arguments), or made from the previous tool output.
Call = tuple[str, Any]
Step = Call | Callable[[str], Call]
BINARY = bytes(range(256)) * 64


class ScriptedModel(Model):
    """Plays back tool calls (function calls, or the freeform `apply_patch`), then answers."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.outputs: list[str] = []  # what the model was shown of each call, in order

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        **_: Any,
    ) -> ModelResponse:
        items = input if isinstance(input, list) else []
        self.outputs = [
            str(item["output"])
            for item in items
            if isinstance(item, dict)
            and item.get("type") in ("function_call_output", "custom_tool_call_output")
        ]
        turn = len(self.outputs)
        if turn >= len(self.steps):
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            message = ResponseOutputMessage(
                type="message", id="msg", role="assistant", status="completed", content=[text]
            )
            return ModelResponse(output=[message], usage=Usage(), response_id=None)
        step = self.steps[turn]
        name, arguments = step(self.outputs[-1]) if callable(step) else step
        call: Any
        if name == "apply_patch":
            call = ResponseCustomToolCall(
                type="custom_tool_call", call_id=f"call-{turn}", name=name, input=arguments
            )
        else:
            call = ResponseFunctionToolCall(
                type="function_call",
                id=f"fc-{turn}",
                call_id=f"call-{turn}",
                name=name,
                arguments=json.dumps(arguments),
                status="completed",
            )
        return ModelResponse(output=[call], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the tests run the agent without streaming")


def agent(model: ScriptedModel) -> SandboxAgent[Any]:
    return SandboxAgent(name="worker", model=model, capabilities=[Filesystem(), Shell()])


def terminal_reply(output: str) -> Call:
    """Answer the terminal's prompt, in the session the previous call left running."""
    found = re.search(r"Process running with session ID (\d+)", output)
    assert found, f"the terminal did not stay open: {output}"
    return (
        "write_stdin",
        {"session_id": int(found[1]), "chars": "agents\n", "yield_time_ms": 5000},
    )


FIRST_RUN: list[Step] = [
    (
        "exec_command",
        {"cmd": "echo hello > greeting.txt; pwd; python3 -c 'import pandas; print(\"pandas ok\")'"},
    ),
    ("apply_patch", "*** Begin Patch\n*** Add File: notes/todo.md\n+first line\n*** End Patch\n"),
    (
        "apply_patch",
        "*** Begin Patch\n*** Update File: notes/todo.md\n@@\n-first line\n+second line\n"
        "*** End Patch\n",
    ),
    ("exec_command", {"cmd": "ls; cat notes/todo.md"}),
    (
        "exec_command",
        {
            "cmd": "read -p 'name? ' name; [ -t 0 ] && t=a || t=no;"
            ' echo "hello $name from $t terminal"',
            "tty": True,
            "yield_time_ms": 2000,
        },
    ),
    terminal_reply,
]
SECOND_RUN: list[Step] = [("exec_command", {"cmd": "cat greeting.txt notes/todo.md"})]


def check_first_run(outputs: list[str]) -> None:
    exec_out, added, updated, listed, prompt, answered = outputs
    assert "Process exited with code 0" in exec_out, exec_out
    assert "/workspace" in exec_out and "pandas ok" in exec_out, exec_out
    assert "notes/todo.md" in added and "notes/todo.md" in updated, (added, updated)
    assert "greeting.txt" in listed and "second line" in listed, listed
    assert "name? " in prompt and "Process running with session ID" in prompt, prompt
    assert "hello agents from a terminal" in answered, answered
    assert "Process exited with code 0" in answered, answered


def run_config(client: CodeInterpreterSandboxClient, backend: str, **sandbox: Any) -> RunConfig:
    options = CodeInterpreterSandboxClientOptions(backend=backend)
    return RunConfig(
        tracing_disabled=True,  # traces would be sent to OpenAI
        sandbox=SandboxRunConfig(client=client, options=options, **sandbox),
    )


async def run_twice(client: CodeInterpreterSandboxClient, backend: str, snapshots: Path) -> None:
    """A run works in a live session the test holds; its workspace is persisted when the
    session closes; a second run resumes from that state in a new session, hydrated."""
    session = await client.create(
        snapshot=LocalSnapshotSpec(base_path=snapshots),
        options=CodeInterpreterSandboxClientOptions(backend=backend),
    )
    async with session:
        first = ScriptedModel(FIRST_RUN)
        result = await Runner.run(
            agent(first),
            "Set up the workspace.",
            run_config=run_config(client, backend, session=session),
        )
        assert result.final_output == "done"
        check_first_run(first.outputs)
    # Its sandbox is gone: what the second run reads came through the snapshot.
    inner = session._inner
    assert isinstance(inner, CodeInterpreterSandboxSession)
    assert not await session.running() and inner.code_session.session_id is None

    payload = client.serialize_session_state(session.state)
    state = client.deserialize_session_state(json.loads(json.dumps(payload)))
    second = ScriptedModel(SECOND_RUN)
    result = await Runner.run(
        agent(second), "Read it back.", run_config=run_config(client, backend, session_state=state)
    )
    assert result.final_output == "done"
    (shown,) = second.outputs
    assert "hello\nsecond line" in shown, shown


@pytest.fixture
async def embedded(backend_name: str) -> AsyncIterator[CodeInterpreterSandboxClient]:
    client = CodeInterpreterSandboxClient(
        spec=small_spec(), backend_config=backend_config(backend_name)
    )
    try:
        yield client
    finally:
        await client.close()


async def test_a_sandbox_agent_runs_in_an_embedded_sandbox(
    embedded: CodeInterpreterSandboxClient, backend_name: str, tmp_path: Path
) -> None:
    await run_twice(embedded, backend_name, tmp_path)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(default_backend=service_backends()[0]).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == [], "the provider left sessions behind"


async def test_a_sandbox_agent_runs_through_a_running_service(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    try:
        await run_twice(client, backend_name, tmp_path)
    finally:
        await client.close()
    with server.client() as api:
        assert api.get("/v1/sessions").json() == [], "a run left its session behind"


async def test_files_move_whole_and_a_workspace_keeps_modes_links_and_empty_dirs(
    embedded: CodeInterpreterSandboxClient, backend_name: str, tmp_path: Path
) -> None:
    options = CodeInterpreterSandboxClientOptions(backend=backend_name)
    session = await embedded.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    async with session:
        await session.write(Path("data/blob.bin"), io.BytesIO(BINARY))
        assert (await session.read(Path("/workspace/data/blob.bin"))).read() == BINARY
        setup = await session.exec(
            "printf '#!/bin/sh\\necho ran\\n' > run.sh && chmod +x run.sh && ln -s run.sh link.sh"
            " && mkdir -p empty/dir"
        )
        assert setup.ok(), setup.stderr
        names = {Path(entry.path).name for entry in await session.ls(".")}
        assert {"data", "run.sh", "link.sh", "empty"} <= names, names
        with pytest.raises(WorkspaceReadNotFoundError):
            await session.read(Path("missing.txt"))
        # Outside the workspace only with a grant; refused, with the reason, for another user.
        with pytest.raises(ValueError, match="one unprivileged user"):
            await session.exec("id", user="root")

    resumed = await embedded.resume(
        embedded.deserialize_session_state(embedded.serialize_session_state(session.state))
    )
    async with resumed:
        assert (await resumed.read(Path("data/blob.bin"))).read() == BINARY
        ran = await resumed.exec("./link.sh && test -d empty/dir && ls -A")
        assert ran.ok(), ran.stderr
        listed = ran.stdout.decode()
        assert listed.startswith("ran\n") and ".cir-agents-snapshot" not in listed, listed


async def test_a_command_past_its_timeout_is_killed_and_a_terminal_ends_with_the_session(
    embedded: CodeInterpreterSandboxClient, backend_name: str
) -> None:
    options = CodeInterpreterSandboxClientOptions(backend=backend_name)
    session = await embedded.create(options=options)
    async with session:
        with pytest.raises(ExecTimeoutError):
            await session.exec("sleep 600", timeout=1)
        update = await session.pty_exec_start("sleep 700", tty=True, yield_time_s=0.3)
        assert update.process_id is not None and update.exit_code is None
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        code = inner.code_session
        running = await running_commands(code)
        assert any("sleep 700" in line for line in running), running
        assert not any("sleep 600" in line for line in running), running
    # The session is over, and the sandbox with everything it ran.
    assert not await session.running()
    assert code.session_id is None


async def running_commands(code: CodeSession) -> list[str]:
    """The command lines of the sandbox's processes, as a command in it sees them."""
    script = 'for p in /proc/[0-9]*; do tr "\\0" " " < "$p/cmdline"; echo; done'
    listing = await code.start_process(ProcessRequest(command=script))
    result = await code.wait_process(listing.pid)
    return [line for line in result.stdout.splitlines() if line.strip()]


async def test_a_terminal_nobody_polls_keeps_its_latest_output_within_a_bound() -> None:
    terminal = Terminal(pid=1, tty=True)
    chunk = b"x" * (32 << 10)
    for _ in range(3 * TERMINAL_BUFFER_BYTES // len(chunk)):
        await terminal.add(chunk)
    await terminal.add(b"the latest line\n")
    kept = b"".join(terminal.chunks)
    assert len(kept) <= TERMINAL_BUFFER_BYTES + 100
    assert kept.startswith(b"\n[... earlier output dropped") and kept.count(b"dropped") == 1
    assert kept.endswith(b"the latest line\n")
