"""A key's policy, enforced by the live service behind every front door: each request outside it
is a 403 naming the key, the rule and what the rule allows (the tool fronts: a refused tool
output the model reads), and what a request leaves unset is fitted within it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from orchestrator.auth import owner_of
from tests.orchestrator.governance.conftest import (
    ADMIN_KEY,
    KEY_A,
    eventually,
    run_keys,
    unique_name,
)
from tests.orchestrator.service.conftest import Server, service_backends


def refused(response: httpx.Response, rule: str, name: str) -> str:
    """The refusal's message, checked to be a 403 naming the key and the rule."""
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "PolicyDenied"
    message: str = error["message"]
    assert f"key {name!r}" in message and f"`{rule}`" in message, message
    assert "code-interpreter keys set-policy" in message
    return message


@pytest.fixture(scope="module")
def restricted(governed_server: Server) -> Iterator[tuple[str, str]]:
    """A key held to local, Python, no network, the `add` tool, 1 GiB, one session and no
    commands: (its name, the key)."""
    name = unique_name("analyst")
    made = run_keys(
        governed_server,
        "add", name,
        "--backends", "local",
        "--languages", "python",
        "--network", "none",
        "--tools", "add",
        "--images", "only-this-image:latest",
        "--max-limit", "memory_mb=1024",
        "--max-sessions", "1",
        "--no-commands",
    )  # fmt: skip
    assert made.exit_code == 0, made.stderr
    key = made.stdout.strip()
    with governed_server.client(key) as api:
        assert eventually(lambda: api.get("/v1/whoami").status_code == 200)
    yield name, key
    run_keys(governed_server, "revoke", name)


@pytest.fixture(scope="module")
def restricted_session(
    governed_server: Server, restricted: tuple[str, str]
) -> Iterator[dict[str, Any]]:
    """The restricted key's one session (local), as created."""
    with governed_server.client(restricted[1]) as api:
        created = api.post("/v1/sessions", json={"backend": "local", "tools": ["add"]})
        assert created.status_code == 201, created.text
        yield created.json()
        api.delete(f"/v1/sessions/{created.json()['id']}")


def test_whoami_says_the_keys_name_admin_and_policy(
    governed_server: Server, restricted: tuple[str, str]
) -> None:
    name, key = restricted
    with governed_server.client(key) as api:
        me = api.get("/v1/whoami").json()
    assert me["name"] == name and me["admin"] is False and me["id"].startswith("p_")
    assert me["policy"]["backends"] == ["local"] and me["policy"]["commands"] is False
    assert me["policy"]["max_limits"] == {"memory_mb": 1024}
    # The settings' keys keep working as before: full access, named by their owner id.
    with governed_server.client(KEY_A) as api:
        me = api.get("/v1/whoami").json()
    assert me == {
        "id": owner_of(KEY_A),
        "name": f"key-{owner_of(KEY_A)[:8]}",
        "admin": False,
        "policy": {**me["policy"], "backends": None, "commands": True, "self_approve": True},
    }
    with governed_server.client(ADMIN_KEY) as api:
        assert api.get("/v1/whoami").json()["admin"] is True
    with governed_server.client("cir_not-a-key") as api:
        assert api.get("/v1/whoami").status_code == 401


def test_a_key_limited_to_local_cannot_create_a_docker_session(
    governed_server: Server, restricted: tuple[str, str]
) -> None:
    name, key = restricted
    with governed_server.client(key) as api:
        message = refused(api.post("/v1/sessions", json={"backend": "docker"}), "backends", name)
        assert "may not use the docker backend" in message and "allows: local" in message
        assert all(s["backend"] == "local" for s in api.get("/v1/sessions").json())


def test_what_a_new_session_asks_for_is_held_to_the_policy(
    governed_server: Server, restricted: tuple[str, str]
) -> None:
    """Images, network, host tools and limits: each refused before any sandbox is made."""
    name, key = restricted
    with governed_server.client(key) as api:
        message = refused(
            api.post("/v1/sessions", json={"backend": "local", "image": "other:latest"}),
            "images",
            name,
        )
        assert "only-this-image:latest" in message
        message = refused(
            api.post("/v1/sessions", json={"backend": "local", "network": "any"}), "network", name
        )
        assert "allows at most: none" in message
        message = refused(
            api.post("/v1/sessions", json={"backend": "local", "tools": ["add", "echo"]}),
            "host_tools",
            name,
        )
        assert "echo" in message and "allows: add" in message
        message = refused(
            api.post("/v1/sessions", json={"backend": "local", "limits": {"memory_mb": 4096}}),
            "max_limits",
            name,
        )
        assert "memory_mb=4096" in message and "at most memory_mb=1024" in message


def test_limits_left_unset_are_capped_and_the_session_cap_holds(
    governed_server: Server, restricted: tuple[str, str], restricted_session: dict[str, Any]
) -> None:
    name, key = restricted
    # The service's default is 2048 MiB: this key's sessions get its ceiling instead.
    assert restricted_session["limits"]["memory_mb"] == 1024
    assert restricted_session["tools"] == ["add"]
    with governed_server.client(key) as api:
        message = refused(api.post("/v1/sessions", json={"backend": "local"}), "max_sessions", name)
        assert "holds 1" in message and "End one first" in message


def test_languages_and_commands_are_refused_in_the_session(
    governed_server: Server, restricted: tuple[str, str], restricted_session: dict[str, Any]
) -> None:
    name, key = restricted
    sid = restricted_session["id"]
    with governed_server.client(key) as api:
        done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1 + 1"})
        assert done.status_code == 200 and done.json()["results"][0]["text"] == "2"
        # A language the sandbox has (the local backend runs bash) but the key may not run.
        assert "bash" in restricted_session["languages"]
        message = refused(
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "echo hi", "language": "sh"}),
            "languages",
            name,
        )
        assert "may not run bash code" in message and "allows: python" in message
        streamed = {"code": "echo hi", "language": "bash"}
        refused(api.post(f"/v1/sessions/{sid}/execute/stream", json=streamed), "languages", name)
        refused(
            api.post(f"/v1/sessions/{sid}/restart", json={"language": "bash"}), "languages", name
        )
        message = refused(
            api.post(f"/v1/sessions/{sid}/commands", json={"command": "echo hi"}), "commands", name
        )
        assert "is off" in message
        refused(
            api.post(f"/v1/sessions/{sid}/processes", json={"command": "sleep 5"}), "commands", name
        )
        refused(
            api.post(f"/v1/sessions/{sid}/commands/stream", json={"command": "echo hi"}),
            "commands",
            name,
        )


def test_the_refusals_say_the_rules_govern_the_api_not_the_sandboxs_programs(
    governed_server: Server, restricted: tuple[str, str], restricted_session: dict[str, Any]
) -> None:
    """`languages` and `commands` choose what the API runs; the key's Python can still start
    the sandbox's programs (inside its walls). The refusals and docs/governance.md say so
    rather than promise more."""
    name, key = restricted
    sid = restricted_session["id"]
    with governed_server.client(key) as api:
        message = refused(
            api.post(f"/v1/sessions/{sid}/commands", json={"command": "echo hi"}), "commands", name
        )
        assert "refuses the commands, processes and terminal APIs" in message
        assert "can still start programs inside its own sandbox" in message
        message = refused(
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "echo hi", "language": "bash"}),
            "languages",
            name,
        )
        assert "chooses the kernels the API runs" in message
        # What the rules leave alone, as the refusals say: a program started from Python.
        ran = api.post(
            f"/v1/sessions/{sid}/execute",
            json={
                "code": "import subprocess\n"
                "print(subprocess.run(['bash', '-c', 'echo from-bash'], capture_output=True,"
                " text=True).stdout)"
            },
        )
        assert ran.status_code == 200 and "from-bash" in ran.json()["stdout"], ran.text
    governance = (Path(__file__).parents[3] / "docs" / "governance.md").read_text()
    assert "**the API, not the sandbox.**" in governance


def test_the_tool_fronts_get_a_refused_output_not_an_error(
    governed_server: Server, restricted: tuple[str, str], restricted_session: dict[str, Any]
) -> None:
    name, key = restricted
    sid = restricted_session["id"]

    def invoke(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        with governed_server.client(key) as api:
            answer = api.post(
                f"/v1/tools/{tool}/invoke",
                json={"arguments": json.dumps(arguments), "call_id": "c1"},
            )
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    shell = invoke("run_command", {"command": "echo hi", "session_id": sid})
    assert shell["status"] == "policy_denied"
    assert "`commands`" in json.dumps(shell["output"]) and name in json.dumps(shell["output"])
    code = invoke("code_interpreter", {"code": "echo hi", "language": "bash", "session_id": sid})
    assert code["status"] == "policy_denied" and "`languages`" in json.dumps(code["output"])
    # A new session is refused too (the key holds its one): said to the model, not a 500.
    new = invoke("code_interpreter", {"code": "1 + 1"})
    assert new["status"] == "policy_denied" and "`max_sessions`" in json.dumps(new["output"])


def test_a_tool_fronts_own_session_leaves_out_the_default_tools_the_key_may_not_use(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    """The service's tool sessions get `add` and `echo`; a key allowed `add` alone gets it
    alone (no error: the model asked for neither)."""
    key = add_key(unique_name("tool-user"), "--tools", "add", "--backends", "local")
    code = "import host_tools\nawait host_tools.add(40, b=2)"
    with governed_server.client(key) as api:
        answer = api.post(
            "/v1/tools/code_interpreter/invoke",
            json={"arguments": json.dumps({"code": code}), "call_id": "c1"},
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["status"] == "ok", body
        assert "42" in json.dumps(body["output"])
        info = api.get(f"/v1/sessions/{body['session_id']}").json()
        assert info["tools"] == ["add"]
        api.delete(f"/v1/sessions/{body['session_id']}")


@pytest.mark.skipif("docker" not in service_backends(), reason="docker cannot run here")
def test_a_key_allowed_docker_alone_may_not_use_local(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    """The other way round, with no session made: the rule names what it allows."""
    name = unique_name("docker-only")
    key = add_key(name, "--backends", "docker")
    with governed_server.client(key) as api:
        message = refused(api.post("/v1/sessions", json={"backend": "local"}), "backends", name)
        assert "allows: docker" in message


async def test_mcp_clients_read_the_rule_in_a_refused_tool_output(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    """The real MCP SDK client over /mcp: a call outside the key's policy is an error result
    naming the rule, and the connection goes on."""
    name = unique_name("mcp-user")
    key = add_key(name, "--languages", "python", "--no-commands", "--backends", "local")
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        transport = streamable_http_client(f"{governed_server.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy") as client:
            bash = await client.call_tool("code_interpreter", {"code": "echo", "language": "bash"})
            assert bash.is_error and "`languages`" in text_of(bash) and name in text_of(bash)
            shell = await client.call_tool("run_command", {"command": "echo hi"})
            assert shell.is_error and "`commands`" in text_of(shell)
            ok = await client.call_tool("code_interpreter", {"code": "6 * 7"})
            assert not ok.is_error and "42" in text_of(ok)
    with governed_server.client(key) as api:  # the connection's session ended with it
        assert eventually(lambda: api.get("/v1/sessions").json() == [])


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def test_the_e2b_front_is_held_to_the_policy_too(
    governed_server: Server, add_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's unmodified SDK: a template (backend) outside the policy is refused at creation,
    and a command in an allowed sandbox names the `commands` rule."""
    name = unique_name("e2b-user")
    key = add_key(name, "--no-commands", "--backends", "local")
    for variable in ("E2B_DEBUG", "E2B_DOMAIN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("E2B_API_URL", governed_server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", governed_server.url)
    monkeypatch.setenv("E2B_API_KEY", key)
    with pytest.raises(SandboxException) as refused_docker:
        Sandbox.create(template="docker")
    assert "403" in str(refused_docker.value) and "`backends`" in str(refused_docker.value)
    sandbox = Sandbox.create(template="local")
    try:
        assert sandbox.run_code("6 * 7").text == "42"
        with pytest.raises(SandboxException) as refused_command:
            sandbox.commands.run("echo hi")
        assert f"key {name!r}" in str(refused_command.value)
        assert "`commands` is off" in str(refused_command.value)
    finally:
        sandbox.kill()
