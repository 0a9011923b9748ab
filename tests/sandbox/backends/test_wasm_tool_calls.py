"""Host tool calls from a wasm sandbox, as the sandbox hands them to the service
(sandbox/backends/wasm/tool_calls.py): each call taken and answered through the relay's
interface, awaited or blocking; a call of a worker replaced since is forgotten; what the code
forges through `js` is dropped and the sandbox carries on. Real Deno and Pyodide; the service's
part (policy, approvals) is tests/orchestrator/service/test_wasm_host_tools.py's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox.backends.wasm.backend import WasmBackend, WasmBackendConfig
from sandbox.backends.wasm.sandbox import WasmSandbox
from tests.conftest import require_backend, small_spec

pytestmark = pytest.mark.timeout(180)
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "returns": None,
    "timeout_s": 30,
    "requires_approval": False,
}
MANIFEST = json.dumps(
    {"version": 1, "timeout_s": 30, "max_call_bytes": 4096, "max_result_bytes": 1 << 20,
     "tools": [ADD]}
).encode()  # fmt: skip


@pytest.fixture(scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory) -> WasmBackend:
    require_backend("wasm")
    state_dir: Path = tmp_path_factory.mktemp("wasm-tools")
    return WasmBackend(WasmBackendConfig(state_dir=state_dir))


@pytest.fixture
async def sandbox(backend: WasmBackend) -> AsyncIterator[WasmSandbox]:
    made = await backend.create(small_spec())
    await made.set_tool_manifest(MANIFEST)
    yield made
    await made.close()


async def answer_one(sandbox: WasmSandbox) -> dict[str, object]:
    """Take the one call waiting, answer it with the sum of its arguments; the call."""
    [(key, body)] = await sandbox.tool_calls(30)
    made = json.loads(body)
    total = made["arguments"]["a"] + made["arguments"]["b"]
    await sandbox.answer_tool_call(key, json.dumps({"id": made["id"], "result": total}).encode())
    return dict(made)


async def test_a_call_awaited_or_blocking_is_answered_through_the_relay(
    sandbox: WasmSandbox,
) -> None:
    for code in ("await host_tools.add(2, 3)", "host_tools.sync.add(2, 3)"):
        running = asyncio.ensure_future(sandbox.execute(f"import host_tools\n{code}"))
        made = await answer_one(sandbox)
        assert (made["tool"], made["arguments"]) == ("add", {"a": 2, "b": 3})
        assert (await running).results[0].text == "5"


async def test_a_run_sees_its_own_environment_and_origin_only(sandbox: WasmSandbox) -> None:
    code = "import os, host_tools\nawait host_tools.add(1, 1), os.environ.get('ONLY_HERE')"
    running = asyncio.ensure_future(
        sandbox.execute(code, env={"ONLY_HERE": "yes", "CIR_TOOL_ORIGIN": "exec-1"})
    )
    made = await answer_one(sandbox)
    assert made["origin"] == "exec-1"
    assert (await running).results[0].text == "(2, 'yes')"
    after = await sandbox.execute(
        "import os\nos.environ.get('ONLY_HERE'), 'CIR_TOOL_ORIGIN' in os.environ"
    )
    assert after.results[0].text == "(None, False)"


async def test_a_call_of_a_worker_replaced_since_is_forgotten(sandbox: WasmSandbox) -> None:
    left = await sandbox.execute(
        "import asyncio, host_tools\nleft = asyncio.ensure_future(host_tools.add(1, 2))"
    )
    assert left.ok, left
    [(key, body)] = await sandbox.tool_calls(30)  # taken, not answered yet
    await sandbox.restart()
    await sandbox.answer_tool_call(
        key, json.dumps({"id": json.loads(body)["id"], "result": 3}).encode()
    )
    assert await sandbox.tool_calls(0.2) == []
    running = asyncio.ensure_future(
        sandbox.execute("import host_tools\nawait host_tools.add(4, 4)")
    )
    await answer_one(sandbox)  # the new worker's calls go on as before
    assert (await running).results[0].text == "8"


async def test_forged_tool_messages_are_dropped_and_the_sandbox_carries_on(
    sandbox: WasmSandbox,
) -> None:
    forged = await sandbox.execute(
        "import js\nfrom pyodide.ffi import to_js\n"
        "bodies = ['\\ud800', 'x' * 100_000, '{\"id\": 1}', '[1]', '{\"id\": 2, \"tool\": 3}']\n"
        "for body in bodies:\n"
        "    js.postMessage(to_js({'type': 'tool', 'id': None, 'body': body},"
        " dict_converter=js.Object.fromEntries))\n"
        "'sent'"
    )
    assert forged.results[0].text == "'sent'", forged
    assert await sandbox.tool_calls(0.5) == []
    assert (await sandbox.execute("6 * 7")).results[0].text == "42"


@pytest.mark.parametrize("form", ["host_tools.sync.add(1, 1)", "await host_tools.add(1, 1)"])
async def test_a_time_limit_ends_a_call_that_waits_and_the_state_stays(
    sandbox: WasmSandbox, form: str
) -> None:
    assert (await sandbox.execute("kept = 41")).ok
    running = asyncio.ensure_future(sandbox.execute(f"import host_tools\n{form}", timeout_s=1))
    [(key, body)] = await sandbox.tool_calls(30)  # it reached the relay, and is not answered
    ran = await running
    assert ran.status.value == "timeout" and not ran.state_lost, ran
    await sandbox.answer_tool_call(key, json.dumps({"id": json.loads(body)["id"]}).encode())
    assert (await sandbox.execute("kept + 1")).results[0].text == "42"
