"""The MCP server, reached with the `mcp` package's own client over stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, EmbeddedResource, ImageContent, TextContent

from orchestrator.release import DISTRIBUTION
from tests.conftest import TEST_ORCHESTRATOR_ID
from tests.orchestrator.service.conftest import (
    KEY_A,
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)

PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()\nprint('plotted')"
MODES = ["auto", "legacy"]  # auto speaks 2026-07-28 (no connections); legacy has a handshake
UPLOAD_LIMIT = 100_000  # the HTTP server's max_upload_bytes: small enough to pass in a test


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def session_of(result: CallToolResult) -> str:
    return text_of(result).rsplit("session_id ", 1)[1].split()[0]


async def check_state_images_and_files(client: Client) -> None:
    """What every transport must do: state across calls, images as images, files both ways."""
    first = await client.call_tool("code_interpreter", {"code": "x = 20"})
    assert not first.is_error, text_of(first)
    second = await client.call_tool("code_interpreter", {"code": "x * 2 + 2"})
    assert "[result]\n42" in text_of(second)
    assert session_of(first) == session_of(second)

    plotted = await client.call_tool("code_interpreter", {"code": PLOT})
    images = [c for c in plotted.content if isinstance(c, ImageContent)]
    assert "plotted" in text_of(plotted) and len(images) == 1
    assert images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG")

    await client.call_tool("upload_file", {"path": "in/data.csv", "content": "a,b\n1,2\n3,4\n"})
    png = base64.b64encode(base64.b64decode(images[0].data)).decode()
    await client.call_tool(
        "upload_file", {"path": "plot.png", "content": png, "encoding": "base64"}
    )
    summed = await client.call_tool(
        "code_interpreter",
        {"code": "import pandas as pd\nd = pd.read_csv('in/data.csv')\n"
         "open('out.bin', 'wb').write(bytes(range(256)))\nint(d.b.sum())"},
    )  # fmt: skip
    assert "[result]\n6" in text_of(summed)
    listed = text_of(await client.call_tool("list_files", {}))
    assert "in/data.csv\t12" in listed and "plot.png" in listed and "out.bin\t256" in listed
    csv = await client.call_tool("download_file", {"path": "in/data.csv"})
    assert text_of(csv) == "a,b\n1,2\n3,4\n"
    image = await client.call_tool("download_file", {"path": "plot.png"})
    assert isinstance(image.content[0], ImageContent)
    binary = await client.call_tool("download_file", {"path": "out.bin"})
    [blob] = binary.content
    assert isinstance(blob, EmbeddedResource)
    assert base64.b64decode(blob.resource.blob) == bytes(range(256))  # type: ignore[union-attr]


async def check_errors_are_results(client: Client) -> None:
    raised = await client.call_tool("code_interpreter", {"code": "1 / 0"})
    assert raised.is_error and "ZeroDivisionError" in text_of(raised)
    empty = await client.call_tool("code_interpreter", {"code": ""})
    assert empty.is_error
    outside = await client.call_tool("download_file", {"path": "../../etc/passwd"})
    assert outside.is_error and "path" in text_of(outside).lower()
    unknown = await client.call_tool("code_interpreter", {"code": "1", "session_id": "s-nope"})
    assert unknown.is_error and "no session s-nope" in text_of(unknown)


# --- stdio: the way a desktop client starts the server


@pytest.fixture
def stdio_env(backend_name: str) -> Iterator[dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="cir-mcp-", dir="/tmp"))
    root.chmod(0o711)
    env = {
        **os.environ,
        "CODE_INTERPRETER_STATE_DIR": str(root / "state"),
        "CODE_INTERPRETER_BACKENDS": backend_name,
        "CODE_INTERPRETER_DEFAULT_BACKEND": backend_name,
        "CODE_INTERPRETER_ORCHESTRATOR_ID": TEST_ORCHESTRATOR_ID,
    }
    env.pop("CODE_INTERPRETER_API_KEYS", None)  # stdio needs none
    try:
        yield env
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_keeps_one_session_for_the_connection(
    stdio_env: dict[str, str], mode: Any
) -> None:
    command = StdioServerParameters(
        command=sys.executable, args=["-m", "orchestrator", "mcp"], env=stdio_env
    )
    async with Client(command, mode=mode) as client:
        # The server says which release it is, as the CLI and the HTTP API do.
        info = client.server_info
        assert info is not None and info.name == "code-interpreter"
        assert info.version == importlib.metadata.version(DISTRIBUTION)
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"code_interpreter", "upload_file", "list_files", "download_file"}
        schema = tools["code_interpreter"].input_schema
        assert schema["required"] == ["code"]
        await check_state_images_and_files(client)
        await check_errors_are_results(client)
    # The client left: the server closes its sandbox and removes its own state dir. On a busy
    # machine the client may kill a server slow to exit (the SDK waits 2 s): then what is left
    # is an orphan of a dead process, which the next server removes (the test below).
    states = Path(stdio_env["CODE_INTERPRETER_STATE_DIR"]) / "mcp-stdio"
    for _ in range(100):
        if not list(states.iterdir()):
            break
        await asyncio.sleep(0.1)
    alive = [p for p in states.iterdir() if Path(f"/proc/{p.name}").exists()]
    assert alive == [], "a server outlived its client"


async def test_stdio_servers_of_two_clients_run_side_by_side(stdio_env: dict[str, str]) -> None:
    """Desktop clients start a server each, on one state dir; a crashed one's leftovers go."""
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    leftover = Path(stdio_env["CODE_INTERPRETER_STATE_DIR"]) / "mcp-stdio" / str(dead.pid)
    (leftover / "local" / "0123456789abcdef" / "workspace").mkdir(parents=True)
    command = StdioServerParameters(
        command=sys.executable, args=["-m", "orchestrator", "mcp"], env=stdio_env
    )
    async with Client(command) as first, Client(command) as second:
        for client, value in ((first, 1), (second, 2)):
            await client.call_tool("code_interpreter", {"code": f"x = {value}"})
        for client, value in ((first, 1), (second, 2)):
            result = await client.call_tool("code_interpreter", {"code": "x"})
            assert str(value) in result.content[0].text  # type: ignore[union-attr]
        assert not leftover.exists()
    # Both servers remove their own directories on the way out; one the SDK had to kill (its
    # 2 s grace, on a busy machine) leaves a dead process's directory, which the next server
    # to start removes.
    states = leftover.parent
    for _ in range(100):
        if not list(states.iterdir()):
            return
        await asyncio.sleep(0.1)
    left = {p.name for p in states.iterdir()}
    assert not [name for name in left if Path(f"/proc/{name}").exists()], "a server lived on"
    async with Client(command) as third:
        await third.list_tools()
        assert not left & {p.name for p in states.iterdir()}, "a dead server's directory stayed"


async def test_stdio_offers_run_command_only_when_the_operator_turns_it_on(
    stdio_env: dict[str, str],
) -> None:
    off = StdioServerParameters(
        command=sys.executable, args=["-m", "orchestrator", "mcp"], env=stdio_env
    )
    async with Client(off) as client:
        assert "run_command" not in {t.name for t in (await client.list_tools()).tools}
    on = StdioServerParameters(
        command=sys.executable,
        args=["-m", "orchestrator", "mcp"],
        env={**stdio_env, "CODE_INTERPRETER_SHELL_TOOL": "true"},
    )
    async with Client(on) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert "run_command" in tools and "code_interpreter" in tools
        schema = tools["run_command"].input_schema
        assert schema["required"] == ["command"]
        assert {"command", "timeout_s", "session_id"} <= set(schema["properties"])
        # The connection's one session: what the code wrote, the shell sees, and back.
        first = await client.call_tool(
            "code_interpreter", {"code": "open('from_code.txt', 'w').write('hi from code')"}
        )
        listed = await client.call_tool("run_command", {"command": "ls; cat from_code.txt"})
        assert not listed.is_error, text_of(listed)
        assert "from_code.txt" in text_of(listed) and "hi from code" in text_of(listed)
        assert session_of(listed) == session_of(first)
        await client.call_tool("run_command", {"command": "echo 6 > from_shell.txt"})
        read = await client.call_tool(
            "code_interpreter", {"code": "7 * int(open('from_shell.txt').read())"}
        )
        assert "[result]\n42" in text_of(read)
        failed = await client.call_tool("run_command", {"command": "echo nope >&2; exit 4"})
        assert failed.is_error and "exit code 4" in text_of(failed) and "nope" in text_of(failed)
        timed = await client.call_tool("run_command", {"command": "sleep 60", "timeout_s": 1})
        assert timed.is_error and "time limit of 1 s" in text_of(timed), text_of(timed)


# --- streamable HTTP: the service's /mcp, with its keys


@pytest.fixture(scope="module", params=service_backends())
def mcp_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    backend = request.param
    srv = make_server(default_backend=backend, max_upload_bytes=UPLOAD_LIMIT).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@asynccontextmanager
async def http_client(server: Server, mode: Any, key: str = KEY_A) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        transport = streamable_http_client(f"{server.url}/mcp", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


def session_count(server: Server, key: str = KEY_A) -> int:
    with server.client(key) as api:
        return len(api.get("/v1/sessions").json())


async def test_http_connection_keeps_a_session_and_ending_it_ends_the_sandbox(
    mcp_server: Server,
) -> None:
    before = session_count(mcp_server)
    async with http_client(mcp_server, "legacy") as client:
        await check_state_images_and_files(client)
        await check_errors_are_results(client)
        assert session_count(mcp_server) == before + 1
    assert session_count(mcp_server) == before  # the client's DELETE ended it


async def test_http_without_connections_continues_by_session_id(mcp_server: Server) -> None:
    async with http_client(mcp_server, "auto") as client:
        first = await client.call_tool("code_interpreter", {"code": "y = 5"})
        sid = session_of(first)
        again = await client.call_tool("code_interpreter", {"code": "y + 1", "session_id": sid})
        assert "[result]\n6" in text_of(again) and session_of(again) == sid
        fresh = await client.call_tool("code_interpreter", {"code": "'y' in dir()"})
        assert "[result]\nFalse" in text_of(fresh) and session_of(fresh) != sid
        # Files need a session named: a new, empty one would be of no use.
        nowhere = await client.call_tool("list_files", {})
        assert nowhere.is_error and "no session to use yet" in text_of(nowhere)
        # A text file longer than a model is shown is trimmed, with a note.
        long = {"path": "long.txt", "content": "x" * 30_000, "session_id": sid}
        assert not (await client.call_tool("upload_file", long)).is_error
        named = {"path": "long.txt", "session_id": sid}
        read = text_of(await client.call_tool("download_file", named))
        assert read.startswith("x" * 20_000) and "10000 more characters are left out" in read
    with mcp_server.client() as api:
        for session in (sid, session_of(fresh)):
            assert api.delete(f"/v1/sessions/{session}").status_code == 204


async def test_http_upload_over_the_limit_tells_the_model_the_limit(mcp_server: Server) -> None:
    """The upload cap is the service's: a file one byte over is refused with the limit named
    and what to do, before a sandbox is started for it, and nothing is written; a file at the
    limit goes in."""
    async with http_client(mcp_server, "legacy") as client:
        over = {"path": "big.txt", "content": "x" * (UPLOAD_LIMIT + 1)}
        refused = await client.call_tool("upload_file", over)
        told = text_of(refused)
        assert refused.is_error and f"upload limit of {UPLOAD_LIMIT}" in told, told
        assert "smaller parts" in told, told
        # Refused before any sandbox was started for it: the connection has no session yet.
        none_yet = await client.call_tool("list_files", {})
        assert none_yet.is_error and "no session to use yet" in text_of(none_yet)
        at_limit = {"path": "fits.txt", "content": "y" * UPLOAD_LIMIT}
        assert not (await client.call_tool("upload_file", at_limit)).is_error
        listed = text_of(await client.call_tool("list_files", {}))
        assert f"fits.txt\t{UPLOAD_LIMIT}" in listed and "big.txt" not in listed, listed


async def test_http_needs_a_key_and_keeps_keys_apart(mcp_server: Server) -> None:
    async with http_client(mcp_server, "legacy") as client:
        mine = session_of(await client.call_tool("code_interpreter", {"code": "secret = 1"}))
        async with http_client(mcp_server, "legacy", key=KEY_B) as other:
            stolen = await other.call_tool(
                "code_interpreter", {"code": "secret", "session_id": mine}
            )
            assert stolen.is_error and f"no session {mine}" in text_of(stolen)
    async with httpx.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await http.post(
                f"{mcp_server.url}/mcp",
                json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                headers={**headers, "Accept": "application/json, text/event-stream"},
            )
            assert response.status_code == 401
