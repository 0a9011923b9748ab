"""Host tools called from sandboxed code, on every backend: discovery, calls, concurrency, every
kind of failure, and the channel's walls."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend
from tests.conftest import small_spec
from tests.orchestrator.host_tools.conftest import RAW_CLIENT, ToolSandbox


async def test_tools_are_discoverable_with_help_and_dir(tool_sandbox: ToolSandbox) -> None:
    listing = await tool_sandbox.run("[n for n in dir(host_tools) if not n.startswith('_')]")
    for name in ("add", "slow", "fail", "sync", "ToolError", "ToolTimeout"):
        assert f"'{name}'" in listing
    assert "'secret'" not in listing  # registered, but not allowed to this session
    helped = await tool_sandbox.run("help(host_tools.add)")
    assert "add(a: int, *, b: int = 2) -> int" in helped
    assert "Add two integers." in helped and "a: The first." in helped
    module_help = await tool_sandbox.run("help(host_tools)")
    assert "slow(seconds: float) -> float: Sleep on the host" in module_help
    assert "sync" in module_help
    kinds = await tool_sandbox.run(
        "import inspect; (inspect.iscoroutinefunction(host_tools.add), "
        "inspect.iscoroutinefunction(host_tools.sync.add), "
        "str(inspect.signature(host_tools.sync.add)))"
    )
    assert kinds == "(True, False, '(a: int, *, b: int = 2) -> int')"


async def test_calls_async_and_blocking(tool_sandbox: ToolSandbox) -> None:
    assert await tool_sandbox.run("await host_tools.add(40)") == "42"
    assert await tool_sandbox.run("await host_tools.add(a=1, b=2)") == "3"
    assert await tool_sandbox.run("host_tools.sync.add(5, b=5)") == "10"
    value = {"list": [1, 2.5, None, True], "text": "héllo\n", "nested": {"k": "v"}}
    assert await tool_sandbox.run(f"host_tools.sync.echo({value!r}) == {value!r}") == "True"


async def test_calls_run_concurrently(tool_sandbox: ToolSandbox) -> None:
    """Ten one-second calls at once take about one second, not ten, for async and sync tools."""
    for tool in ("slow", "blocking_slow"):
        took = await tool_sandbox.run(
            "t0 = time.monotonic()\n"
            f"r = await asyncio.gather(*[host_tools.{tool}(1.0) for _ in range(10)])\n"
            "assert r == [1.0] * 10\n"
            "round(time.monotonic() - t0, 2)"
        )
        assert 1.0 <= float(took) < 5.0, f"{tool}: 10 calls of 1 s took {took} s"


async def test_bad_arguments_are_refused_before_the_tool_runs(tool_sandbox: ToolSandbox) -> None:
    code = (
        "def attempt(f):\n"
        "    try:\n"
        "        f(); return 'ran'\n"
        "    except host_tools.ToolError as e:\n"
        "        return f'{type(e).__name__}|{isinstance(e, ValueError)}|{e}'\n"
        "[attempt(lambda: host_tools.sync.add('one')),\n"
        " attempt(lambda: host_tools.sync.add()),\n"
        " attempt(lambda: host_tools.sync.add(1, c=3)),\n"
        " attempt(lambda: host_tools.sync.echo(object()))]"
    )
    wrong_type, missing, unknown, not_json = eval(await tool_sandbox.run(code))
    assert wrong_type == "ToolArgumentError|True|add: a: 'one' is not of type 'integer'"
    assert missing.startswith("ToolArgumentError|True|add(): missing a required argument")
    assert unknown.startswith("ToolArgumentError|True|add(): got an unexpected keyword")
    assert not_json.startswith("ToolArgumentError|True|echo: the arguments are not JSON")
    # The host checks too: a raw call with a wrong type never reaches the tool.
    raw = await tool_sandbox.run(
        RAW_CLIENT
        + "replies(raw(frame({'id': 1, 'tool': 'add', 'arguments': {'a': 'x', 'z': 1}}), 2)[1])"
    )
    reply = eval(raw)[0]
    assert reply["id"] == 1 and reply["error"]["type"] == "invalid_arguments"
    assert "'x' is not of type 'integer'" in reply["error"]["message"]
    assert "'z' was unexpected" in reply["error"]["message"]


async def test_a_tool_not_allowed_cannot_be_called(tool_sandbox: ToolSandbox) -> None:
    missing = await tool_sandbox.run(
        "try:\n    host_tools.sync.secret\nexcept AttributeError as e:\n    print(e)"
    )
    assert "has no tool 'secret'" in missing
    raw = await tool_sandbox.run(
        RAW_CLIENT + "replies(raw(frame({'id': 'a', 'tool': 'secret', 'arguments': {}}), 2)[1]) + "
        "replies(raw(frame({'id': 'b', 'tool': 'os.system', 'arguments': {}}), 2)[1])"
    )
    for reply in eval(raw):
        assert reply["error"]["type"] == "not_allowed", reply
        assert "the host's secret" not in str(reply)


async def test_a_slow_tool_times_out(tool_sandbox: ToolSandbox) -> None:
    out = await tool_sandbox.run(
        "t0 = time.monotonic()\n"
        "try:\n"
        "    await host_tools.slow(30)\n"
        "except host_tools.ToolTimeout as e:\n"
        "    print(type(e).__name__, isinstance(e, TimeoutError), e)\n"
        "print(round(time.monotonic() - t0))"
    )
    first, took = out.strip().splitlines()
    assert first == "ToolTimeout True slow did not finish within 2 s"
    assert int(took) < 10
    assert await tool_sandbox.run("host_tools.sync.add(1, b=1)") == "2"  # the channel carries on


async def test_sizes_are_capped_both_ways(tool_sandbox: ToolSandbox) -> None:
    out = await tool_sandbox.run(
        "for f in (lambda: host_tools.sync.big(100_000),\n"
        "          lambda: host_tools.sync.echo('y' * 100_000)):\n"
        "    try:\n"
        "        f()\n"
        "    except host_tools.ToolTooLarge as e:\n"
        "        print(e)\n"
        "print(len(host_tools.sync.big(1000)))"
    )
    result_cap, call_cap, fine = out.strip().splitlines()
    assert "big returned" in result_cap and "over the limit of 65536" in result_cap
    assert "echo: the call is" in call_cap and "over the limit of 65536" in call_cap
    assert fine == "1000"
    # A raw oversized frame is refused and the connection closed, before the body is read.
    raw = await tool_sandbox.run(
        RAW_CLIENT + "state, got = raw((10 << 20).to_bytes(4, 'big') + b'{' * 1000)\n"
        "(state, replies(got))"
    )
    state, replies = eval(raw)
    assert state == "closed"
    assert replies[0]["id"] is None and replies[0]["error"]["type"] == "refused"


async def test_a_raising_tool_raises_in_the_sandbox(tool_sandbox: ToolSandbox) -> None:
    out = await tool_sandbox.run(
        "try:\n"
        "    await host_tools.fail('the ledger is locked')\n"
        "except host_tools.ToolFailed as e:\n"
        "    print(type(e).__name__, '|', e)"
    )
    assert out.strip() == "ToolFailed | RuntimeError: the ledger is locked"
    ex = await tool_sandbox.sandbox.execute("host_tools.sync.fail('boom')")
    assert ex.status is ExecutionStatus.ERROR and ex.error is not None
    assert ex.error.name == "ToolFailed" and ex.error.value == "RuntimeError: boom"
    assert "tools_for_tests.py" not in ex.error.traceback  # no host traceback leaks in


@pytest.mark.parametrize(
    "garbage",
    [
        "b'GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'",
        "frame(b'not json at all')",
        "frame({'id': 1, 'tool': 'add'})",
        "frame({'id': 1, 'tool': 'add', 'arguments': [1, 2]})",
        "frame({'id': 1, 'tool': 'add', 'arguments': {}, 'op': 'list'})",
        "frame({'id': True, 'tool': 'add', 'arguments': {}})",
        "frame([1, 2, 3])",
        "b'\\x00\\x00\\x00\\x10{\"id\": 1'",
    ],
)
async def test_the_channel_refuses_garbage(tool_sandbox: ToolSandbox, garbage: str) -> None:
    raw = await tool_sandbox.run(RAW_CLIENT + f"state, got = raw({garbage}, 5)\n(state, got)")
    state, got = eval(raw)
    assert state == "closed"
    assert b'"result"' not in got
    assert await tool_sandbox.run("host_tools.sync.add(2)") == "4"  # others are unaffected


async def test_a_kernel_restart_keeps_the_channel(tool_sandbox: ToolSandbox) -> None:
    await tool_sandbox.sandbox.restart()
    assert await tool_sandbox.run("import host_tools; await host_tools.add(1, b=1)") == "2"
    # A forked child reconnects on its own.
    out = await tool_sandbox.run(
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if host_tools.sync.add(3) == 5 else 1)\n"
        "os.waitpid(pid, 0)[1]"
    )
    assert out == "0"


async def test_the_network_stays_off_while_the_channel_works(
    tool_sandbox: ToolSandbox, host_listener: int
) -> None:
    out = await tool_sandbox.run(
        "import socket\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {host_listener})); reached = True\n"
        "except OSError:\n"
        "    reached = False\n"
        "(reached, [n for _, n in socket.if_nameindex()], host_tools.sync.add(1))"
    )
    assert out == "(False, ['lo'], 3)"


async def test_the_channel_directory_is_read_only_and_ours(tool_sandbox: ToolSandbox) -> None:
    out = await tool_sandbox.run(
        "import os\n"
        "d = os.environ['CIR_HOST_TOOLS_DIR']\n"
        "outcomes = []\n"
        "for attempt in (lambda: open(d + '/planted', 'w'), lambda: os.remove(d + '/sock'),\n"
        "                lambda: os.rename(d + '/manifest.json', d + '/m'),\n"
        "                lambda: open(d + '/host_tools.py', 'a'), lambda: os.mkfifo(d + '/f')):\n"
        "    try:\n"
        "        attempt(); outcomes.append('done')\n"
        "    except OSError:\n"
        "        outcomes.append('refused')\n"
        "(d, sorted(os.listdir(d)), outcomes)"
    )
    where, names, outcomes = eval(out)
    assert where == "/run/host-tools"
    assert names == ["host_tools.py", "manifest.json", "sock"]
    assert outcomes == ["refused"] * 5
    manifest = await tool_sandbox.run("open(d + '/manifest.json').read()")
    assert "tools_for_tests" not in manifest and "secret" not in manifest


@pytest.mark.skipif(os.geteuid() != 0, reason="other uids are told apart only as root")
async def test_only_the_sandboxs_uid_may_connect(tool_sandbox: ToolSandbox) -> None:
    channel = tool_sandbox.sandbox.host_channel
    assert channel is not None
    st = channel.socket_path.stat()
    assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == channel.peer_gid
    assert oct(channel.path.stat().st_mode & 0o777) == "0o750"
    if tool_sandbox.sandbox.backend == "gvisor":
        # A gVisor machine's: the host socket is this service's alone, joined to the agent's
        # socket inside (no host socket can be reached from a machine). Code inside finds the
        # host's socket file in the directory and cannot connect to it.
        inside = await tool_sandbox.sandbox.execute(
            "import os, socket\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "s.connect(os.path.join(os.environ['CIR_HOST_TOOLS_DIR'], 'sock'))"
        )
        assert inside.error is not None and "Error" in inside.error.name, inside
        return

    # We are root, so the file lets us in; the listener's uid check does not.
    def call_as_root() -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(channel.socket_path))
            body = b'{"id": 1, "tool": "add", "arguments": {"a": 1}}'
            try:
                s.sendall(len(body).to_bytes(4, "big") + body)
                return s.recv(100)
            except (BrokenPipeError, ConnectionResetError):  # closed before or after our call
                return b""

    calls = tool_sandbox.channel.calls
    assert await asyncio.to_thread(call_as_root) == b""  # closed, unanswered
    await asyncio.sleep(0.2)
    assert tool_sandbox.channel.calls == calls


async def test_a_sandbox_without_tools_has_no_channel(backend: Backend) -> None:
    async with await backend.create(small_spec()) as sb:
        assert sb.host_channel is None
        ex = await sb.execute(
            "import os, importlib.util\n"
            "(os.path.exists('/run/host-tools'), importlib.util.find_spec('host_tools'), "
            "'CIR_HOST_TOOLS_DIR' in os.environ)"
        )
        assert ex.text == "(False, None, False)", (ex.error, ex.text)


async def test_calls_dropped_with_their_connection_give_back_their_slots(
    tool_sandbox: ToolSandbox,
) -> None:
    # More calls than slots, then the connection closes at once: the host reads the rest while
    # it is already closed and cancels those calls, some before they ever ran.
    burst = (
        RAW_CLIENT
        + "import time\n"
        + "for _ in range(3):\n"
        + "    s = socket.socket(socket.AF_UNIX)\n"
        + "    s.connect(os.environ.get('CIR_HOST_TOOLS_SOCKET')"
        + " or os.path.join(os.environ['CIR_HOST_TOOLS_DIR'], 'sock'))\n"
        + "    s.sendall(b''.join(frame({'id': i, 'tool': 'slow', 'arguments': {'seconds': 0.05}})"
        + " for i in range(100)))\n"
        + "    s.close()\n"
        + "    time.sleep(0.5)\n"
    )
    await tool_sandbox.run(burst)
    await asyncio.sleep(1)
    slots = tool_sandbox.channel._slots
    assert slots._value == tool_sandbox.channel.limits.max_calls_in_flight
    assert "3" in await tool_sandbox.run("await host_tools.add(1, b=2)")
