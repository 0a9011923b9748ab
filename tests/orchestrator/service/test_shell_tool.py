"""The `run_command` tool beside `code_interpreter`: off unless the operator turns it on; on, a
shell in the same session, with exit codes, trimmed output and time limits a model can read."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.service.conftest import Server, leftovers, make_server, service_backends

TRIM_AT = 2000  # the shell server's tool_output_max_chars
# The shell server's execution_timeout_s: the tool's per-call limit. Low, as the test of it
# waits it out; above what a caller that leaves needs to be noticed (3 s and a poll).
TOOL_LIMIT_S = 8


def invoke(
    api: httpx.Client, arguments: object, fmt: str = "openai_chat", tool: str = "run_command"
) -> dict:  # type: ignore[type-arg]
    r = api.post(
        f"/v1/tools/{tool}/invoke",
        json={"arguments": arguments, "format": fmt, "call_id": "call-1"},
    )
    assert r.status_code == 200, r.text
    result: dict = r.json()  # type: ignore[type-arg]
    return result


def text_of(out: dict) -> str:  # type: ignore[type-arg]
    content = out["output"]["content"]
    return content if isinstance(content, str) else str(content[0]["text"])


# --- off by default: the shared server was started without the setting


def test_the_shell_tool_is_off_unless_the_operator_turns_it_on(api: httpx.Client) -> None:
    for response in (
        api.get("/v1/tools/run_command"),
        api.post(
            "/v1/tools/run_command/invoke",
            json={"arguments": {"command": "id"}, "call_id": "call-1"},
        ),
    ):
        assert response.status_code == 404, response.text
        message = response.json()["error"]["message"]
        assert "run_command" in message and "CODE_INTERPRETER_SHELL_TOOL=true" in message
    # The code tool is unchanged beside it.
    assert api.get("/v1/tools/code_interpreter").status_code == 200


# --- on: a server with CODE_INTERPRETER_SHELL_TOOL=true, once per backend


@pytest.fixture(scope="module", params=service_backends())
def shell_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = make_server(
        shell_tool="true",
        default_backend=request.param,
        tool_output_max_chars=TRIM_AT,
        execution_timeout_s=TOOL_LIMIT_S,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def shell_api(shell_server: Server) -> Iterator[httpx.Client]:
    with shell_server.client() as client:
        yield client
        for session in client.get("/v1/sessions").json():
            client.delete(f"/v1/sessions/{session['id']}")


def test_definitions_in_every_format(shell_api: httpx.Client) -> None:
    defs = shell_api.get("/v1/tools/run_command").json()
    schema = defs["json_schema"]
    assert schema["required"] == ["command"]
    assert set(schema["properties"]) == {"command", "session_id", "timeout_s"}
    chat = defs["openai_chat"]
    assert chat["function"]["name"] == "run_command" and chat["function"]["parameters"] == schema
    assert defs["openai_responses"]["name"] == "run_command"
    assert defs["anthropic"]["name"] == "run_command"
    assert defs["anthropic"]["input_schema"] == schema
    assert defs["mcp"]["inputSchema"] == schema
    text = chat["function"]["description"]
    for fact in (
        "shell",
        "exit code",
        "session_id",
        "/workspace",
        "no network",
        "code_interpreter",
    ):
        assert fact.lower() in text.lower(), fact
    assert f"{TOOL_LIMIT_S} seconds" in text
    one = shell_api.get("/v1/tools/run_command", params={"format": "openai_chat"}).json()
    assert one == chat


def test_ls_and_a_shared_session_with_code_interpreter(shell_api: httpx.Client) -> None:
    made = invoke(
        shell_api,
        {"code": "open('from_code.txt', 'w').write('written by python')\nanswer = 41"},
        tool="code_interpreter",
    )
    sid = made["session_id"]
    listed = invoke(shell_api, {"command": "ls", "session_id": sid})
    assert listed["status"] == "ok" and listed["session_id"] == sid
    text = text_of(listed)
    assert "[stdout]\nfrom_code.txt" in text, text
    assert "exit code 0" in text and f"session_id {sid}" in text
    wrote = invoke(
        shell_api,
        {"command": "echo written by the shell > from_shell.txt && pwd", "session_id": sid},
    )
    assert "[stdout]\n/workspace" in text_of(wrote)
    read = invoke(
        shell_api,
        {"code": "answer += 1\nprint(open('from_shell.txt').read().strip(), answer)",
         "session_id": sid},
        tool="code_interpreter",
    )  # fmt: skip
    assert "written by the shell 42" in text_of(read)  # the same kernel: its variable is kept


def test_a_new_session_when_none_is_named(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "echo hello"})
    sid = out["session_id"]
    assert sid and out["status"] == "ok"
    assert "[stdout]\nhello" in text_of(out) and f"session_id {sid}" in text_of(out)


def test_a_failing_command_gives_its_exit_code_and_stderr(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "echo some out; echo went wrong >&2; exit 3"}, "anthropic")
    assert out["status"] == "error"
    text = text_of(out)
    assert "[stdout]\nsome out" in text and "[stderr]\nwent wrong" in text, text
    assert "exit code 3" in text, text
    assert out["output"]["is_error"] is True
    missing = invoke(
        shell_api, {"command": "no-such-program-here", "session_id": out["session_id"]}
    )
    assert missing["status"] == "error" and "exit code 127" in text_of(missing)
    assert "not found" in text_of(missing)


def test_a_command_past_its_time_limit_is_killed_and_said_so(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "echo started; sleep 60; echo never", "timeout_s": 1})
    assert out["status"] == "timeout"
    text = text_of(out)
    assert "[stdout]\nstarted" in text and "never" not in text, text
    assert "time limit of 1 s" in text, text
    # The session carries on.
    after = invoke(shell_api, {"command": "echo still here", "session_id": out["session_id"]})
    assert after["status"] == "ok" and "still here" in text_of(after)


def test_a_time_limit_above_the_tools_own_is_held_to_it(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "sleep 90", "timeout_s": 100_000})
    assert out["status"] == "timeout"
    assert f"time limit of {TOOL_LIMIT_S} s" in text_of(out), text_of(out)


def test_long_output_is_trimmed_and_the_model_is_told(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "seq 1 100000"})
    text = text_of(out)
    assert len(text) < 2 * TRIM_AT + 1000
    assert "[stdout]\n1\n2\n" in text and "100000" in text, text
    assert "characters of output were left out" in text, text


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ('{"command": "ls"', "not valid JSON"),
        ({"session_id": "s-x"}, "'command' is missing"),
        ({"command": ""}, "'command' is empty"),
        ({"command": "ls", "timeout_s": -1}, "'timeout_s'"),
        ({"code": "print(1)"}, "'command' is missing"),
    ],
)
def test_malformed_calls_come_back_as_tool_output(
    shell_api: httpx.Client, arguments: object, says: str
) -> None:
    out = invoke(shell_api, arguments)
    assert out["status"] == "invalid_call" and out["session_id"] is None
    text = text_of(out)
    assert says in text, text
    assert '{"command": "ls -la"}' in text, text  # shows the right shape


def test_an_unknown_session_tells_the_model_what_to_do(shell_api: httpx.Client) -> None:
    out = invoke(shell_api, {"command": "ls", "session_id": "s-000000000000000000000000"})
    assert out["status"] == "session_error"
    assert "no session" in text_of(out) and "Omit session_id" in text_of(out)


def test_a_command_no_shell_can_hold_is_refused_before_a_session_is_made(
    shell_api: httpx.Client,
) -> None:
    before = len(shell_api.get("/v1/sessions").json())
    out = invoke(shell_api, {"command": "echo a\u0000b"})
    assert out["status"] == "invalid_call" and out["session_id"] is None
    assert "NUL" in text_of(out), text_of(out)
    assert len(shell_api.get("/v1/sessions").json()) == before


def test_a_caller_that_leaves_kills_its_command(shell_api: httpx.Client) -> None:
    sid = invoke(shell_api, {"command": "true"})["session_id"]
    command = "touch started; sleep 120"
    with pytest.raises(httpx.ReadTimeout):  # the caller gives up after 3 s and leaves
        shell_api.post(
            "/v1/tools/run_command/invoke",
            json={"arguments": {"command": command, "session_id": sid}, "call_id": "call-1"},
            timeout=3,
        )
    listed = f"/v1/sessions/{sid}/processes"
    deadline = time.monotonic() + 30
    while True:
        [ours] = [
            p
            for p in shell_api.get(listed, params={"include_ended": True}).json()
            if p["command"] == command
        ]
        if not ours["running"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not ours["running"], ours  # killed long before its 120 s
    assert ours["end"]["exit_code"] != 0, ours
    assert not ours["end"]["timed_out"], ours  # by the caller's leaving, not the tool's limit
    ran = invoke(shell_api, {"command": "ls started", "session_id": sid})
    assert ran["status"] == "ok"  # it did start
