"""What is typed into a terminal, or written to a background process's stdin, is in the audit
log (`process.input`) with its session and key, through our API, a terminal's WebSocket and
E2B's SDK; a flood of input makes at most the records the rate allows, each within the record
size, and the bytes dropped are counted. A real `serve` on 127.0.0.1, real local sandboxes."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.governance.conftest import eventually
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

RECORD_BYTES = 64
PER_MINUTE = 5


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(
        backends="local",
        default_backend="local",
        audit_input_record_bytes=RECORD_BYTES,
        audit_input_records_per_minute=PER_MINUTE,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(KEY_A) as client:
        yield client


def new_session(api: httpx.Client) -> str:
    created = api.post("/v1/sessions", json={})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def inputs(api: httpx.Client, sid: str) -> list[dict[str, Any]]:
    """The session's `process.input` events, oldest first."""
    listed = api.get("/v1/audit", params={"session_id": sid, "kind": "process.input"})
    assert listed.status_code == 200, listed.text
    return list(reversed(listed.json()["events"]))


def inputs_when(
    api: httpx.Client, sid: str, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    assert eventually(lambda: done(inputs(api, sid)), within_s=30), inputs(api, sid)
    return inputs(api, sid)


def typed_text(found: list[dict[str, Any]]) -> str:
    return "".join(e["details"].get("text", "") for e in found)


def start_cat(api: httpx.Client, sid: str) -> int:
    started = api.post(f"/v1/sessions/{sid}/processes", json={"argv": ["cat"], "stdin": True})
    assert started.status_code == 201, started.text
    return int(started.json()["pid"])


def test_stdin_written_to_a_background_process_is_recorded(api: httpx.Client) -> None:
    sid = new_session(api)
    me = api.get("/v1/whoami").json()["name"]
    try:
        pid = start_cat(api, sid)
        for data in (b"export TOKEN=abc\n", b"no newline yet"):
            sent = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", content=data)
            assert sent.status_code == 204, sent.text
        # A line is written at once; what has no newline, a moment after its first byte.
        found = inputs_when(api, sid, lambda found: len(found) == 2)
        assert [e["details"]["text"] for e in found] == ["export TOKEN=abc\n", "no newline yet"]
        for event in found:
            assert event["session_id"] == sid and event["principal"] == me, event
            assert event["details"]["pid"] == pid and event["details"]["terminal"] is False
        assert found[0]["details"]["bytes"] == len(b"export TOKEN=abc\n")
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_text_typed_into_a_terminal_is_recorded(server: Server, api: httpx.Client) -> None:
    sid = new_session(api)
    try:
        url = server.url.replace("http://", "ws://") + f"/v1/sessions/{sid}/terminal"
        headers = {"Authorization": f"Bearer {KEY_A}"}
        with connect(url, additional_headers=headers) as ws:
            for key in b"echo typed-by-hand\r":  # one keystroke a frame, as a person types
                ws.send(bytes([key]))
            # In one record or more: keystrokes slower than FLUSH_S apart go in the next one.
            found = inputs_when(api, sid, lambda found: typed_text(found) == "echo typed-by-hand\r")
        assert all(e["details"]["terminal"] is True for e in found), found
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_a_flood_of_input_makes_bounded_records_and_counts_what_it_drops(
    api: httpx.Client,
) -> None:
    sid = new_session(api)
    try:
        pid = start_cat(api, sid)
        flood = b"".join(b"line %05d of the flood\n" % i for i in range(2000))
        sent = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", content=flood)
        assert sent.status_code == 204, sent.text
        # Every record was made (or dropped) before the write was answered.
        kept = inputs_when(api, sid, lambda found: len(found) >= PER_MINUTE)
        assert all(e["details"]["bytes"] <= RECORD_BYTES for e in kept), kept
        api.delete(f"/v1/sessions/{sid}")  # its end tells what the rate dropped
        found = inputs_when(api, sid, lambda got: bool(got) and got[-1]["status"] == "dropped")
        assert len(found) == PER_MINUTE + 1, [e["details"] for e in found]
        told = found[-1]
        assert told["status"] == "dropped" and "text" not in told["details"], told
        recorded = sum(e["details"]["bytes"] for e in found[:-1])
        assert recorded + told["details"]["dropped_bytes"] == len(flood)
        assert told["details"]["dropped_records"] >= (len(flood) - recorded) // RECORD_BYTES
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_e2b_sdk_stdin_and_terminal_input_are_recorded(
    server: Server, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b_code_interpreter import PtySize, Sandbox

    point_sdk_at(monkeypatch, server.url)
    sandbox = Sandbox.create(template="local")
    try:
        cat = sandbox.commands.run("cat", background=True, stdin=True)
        sandbox.commands.send_stdin(cat.pid, "through the sdk\n")
        sandbox.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "through the sdk\n"
        terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
        sandbox.pty.send_stdin(terminal.pid, b"exit 3\n")
        found = inputs_when(api, sandbox.sandbox_id, lambda found: len(found) == 2)
        assert [(e["details"]["text"], e["details"]["terminal"]) for e in found] == [
            ("through the sdk\n", False),
            ("exit 3\n", True),
        ]
    finally:
        sandbox.kill()
