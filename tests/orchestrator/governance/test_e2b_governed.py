"""E2B's front under a key's policy, against the governance tests' `serve` with E2B's unmodified
SDK: its file calls outside the workspace are audited, and shown in the console, as file
transfers (not as the key's commands), and a paused sandbox its traffic would wake, refused by
the key's `max_sessions`, reads as that refusal (not as a sandbox that is gone)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from e2b import SandboxException, SandboxNotFoundException
from e2b_code_interpreter import Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.governance.conftest import eventually, unique_name
from tests.orchestrator.service.conftest import Server


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Sandbox]]:
    """The sandboxes a test made, killed after it (before monkeypatch undoes the SDK's
    environment)."""
    sandboxes: list[Sandbox] = []
    yield sandboxes
    for sandbox in sandboxes:
        sandbox.kill()


def audited(api: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    answer = api.get("/v1/audit", params={"session_id": session_id, "limit": 200})
    assert answer.status_code == 200, answer.text
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


def test_file_calls_outside_the_workspace_are_audited_and_shown_as_file_transfers(
    governed_server: Server,
    add_key: Callable[..., str],
    made: list[Sandbox],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = add_key(unique_name("e2b-files"), "--no-commands")
    point_sdk_at(monkeypatch, governed_server.url, key)
    sandbox = Sandbox.create(template="local")
    made.append(sandbox)
    sandbox.files.write("/tmp/moved/a.txt", "hello")  # a process: written on its stdin
    assert sandbox.files.read("/tmp/moved/a.txt") == "hello"
    assert [e.name for e in sandbox.files.list("/tmp/moved")] == ["a.txt"]  # commands
    sid = sandbox.sandbox_id
    with governed_server.client(key) as api:

        def transfers() -> list[dict[str, Any]]:
            kinds = ("command", "process.started")
            return [e for e in audited(api, sid) if e["kind"] in kinds]

        assert eventually(
            lambda: {e["kind"] for e in transfers()} == {"command", "process.started"}
        )
        for event in transfers():
            assert event["details"].get("file_transfer") is True, event
        # The key's own command is refused, and not a file transfer.
        assert api.post(f"/v1/sessions/{sid}/commands", json={"command": "id"}).status_code == 403
    with httpx.Client(base_url=governed_server.url, timeout=60) as browser:
        assert browser.post("/console/login", data={"key": key}).status_code == 303
        page = browser.get(f"/console/sessions/{sid}").text
        assert page.count('<article class="file-transfer">') == len(transfers_of(page))
        assert 'class="file-transfer"' in page and "/tmp/moved" in page
        assert '<article class="command">' not in page and "$ cat" not in page


def transfers_of(page: str) -> list[str]:
    return page.split('<article class="file-transfer">')[1:]


def test_an_auto_resume_refused_by_max_sessions_says_so(
    governed_server: Server,
    add_key: Callable[..., str],
    made: list[Sandbox],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique_name("e2b-one")
    key = add_key(name, "--max-sessions", "1")
    point_sdk_at(monkeypatch, governed_server.url, key)
    sleeper = Sandbox.create(
        template="local", lifecycle={"on_timeout": "pause", "auto_resume": True}
    )
    made.append(sleeper)
    sleeper.run_code("x = 41")
    assert sleeper.pause() is True
    other = Sandbox.create(template="local")  # the key's one session now
    made.append(other)
    with pytest.raises(SandboxException) as refused:  # the REST side (code): 403
        sleeper.run_code("x + 1")
    assert not isinstance(refused.value, SandboxNotFoundException)
    message = str(refused.value)
    assert "403" in message and f"key {name!r}" in message and "`max_sessions`" in message
    assert "not found" not in message
    with pytest.raises(SandboxException) as refused_files:  # envd's file transfers: 403
        sleeper.files.read("/tmp/none")
    assert "403" in str(refused_files.value) and "`max_sessions`" in str(refused_files.value)
    with pytest.raises(SandboxException) as refused_rpc:  # the Connect side (commands, dirs)
        sleeper.commands.run("true")
    assert not isinstance(refused_rpc.value, SandboxNotFoundException)
    assert "PERMISSION_DENIED" in str(refused_rpc.value).upper()
    assert "`max_sessions`" in str(refused_rpc.value)
    other.kill()
    made.remove(other)
    # Its record was kept: with the slot free, its traffic wakes it, state and all.
    assert sleeper.run_code("x + 1").text == "42"
