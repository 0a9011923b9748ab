"""Processes over the sessions API, against a real server: commands (whole and streamed as
NDJSON), background processes (stdin, output, signals, wait, resize), a terminal over a
WebSocket, and the HTTP client's calls for each. Refusals are typed: another key's session and
a wrong pid are 404, a signal not on the list 400, stdin over the request limit 413."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from code_interpreter_client.http_client import APIError, Client
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server

MAX_REQUEST_BYTES = 16 << 20  # the service's default request size limit


def lines_of(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line:
            yield json.loads(line)


def texts(events: list[dict[str, Any]], *streams: str) -> str:
    return "".join(e["text"] for e in events if e["type"] in streams)


def process_of(api: httpx.Client, session_id: str, pid: int) -> dict[str, Any]:
    listed = api.get(f"/v1/sessions/{session_id}/processes", params={"include_ended": True})
    assert listed.status_code == 200, listed.text
    found = [p for p in listed.json() if p["pid"] == pid]
    assert found, f"pid {pid} not listed: {listed.json()}"
    return found[0]


def wait_until_ended(api: httpx.Client, session_id: str, pid: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = process_of(api, session_id, pid)
        if not info["running"]:
            return info
        time.sleep(0.2)
    raise AssertionError(f"process {pid} still runs after {timeout_s} s")


def tagged(api: httpx.Client, session_id: str, tag: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = api.get(f"/v1/sessions/{session_id}/processes", params={"include_ended": True})
        found = [p for p in listed.json() if p["tag"] == tag]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no process tagged {tag!r}")


# --- commands
def test_root_is_refused_where_the_sandbox_has_none(api: httpx.Client, session_id: str) -> None:
    """Local and Docker sandboxes keep every process unprivileged: 403 naming the way out."""
    for route in ("commands", "processes"):
        refused = api.post(
            f"/v1/sessions/{session_id}/{route}", json={"command": "id -u", "user": "root"}
        )
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "RootUnavailable" and "gvisor backend" in error["message"]
    unknown = api.post(f"/v1/sessions/{session_id}/commands", json={"argv": ["id"], "user": "bob"})
    assert unknown.status_code == 422


def test_a_command_returns_its_whole_result(api: httpx.Client, session_id: str) -> None:
    r = api.post(
        f"/v1/sessions/{session_id}/commands",
        json={"command": 'echo "$GREETING"; pwd; echo oops >&2; exit 3', "env": {"GREETING": "hi"}},
    )
    assert r.status_code == 200, r.text
    result = r.json()
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (
        3,
        "hi\n/workspace\n",
        "oops\n",
    )
    assert result["timed_out"] is False and result["pid"] > 0
    timed = api.post(
        f"/v1/sessions/{session_id}/commands", json={"argv": ["sleep", "60"], "timeout_s": 1}
    ).json()
    assert timed["timed_out"] is True and timed["exit_code"] != 0


def test_a_streamed_command_comes_in_order_decoded_then_ends(
    api: httpx.Client, session_id: str
) -> None:
    # `é` split across two writes: decoded whole, per stream.
    command = (
        "echo one; sleep 0.3; echo two >&2; sleep 0.3; printf '\\303'; sleep 0.3; "
        "printf '\\251\\n'; sleep 6; echo three"
    )
    with api.stream(
        "POST", f"/v1/sessions/{session_id}/commands/stream", json={"command": command}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        events = list(lines_of(r))
    assert events[0]["type"] == "start" and events[0]["pid"] > 0
    assert events[-1]["type"] == "end"
    result = events[-1]["result"]
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (
        0,
        "one\né\nthree\n",
        "two\n",
    )
    assert result["pid"] == events[0]["pid"]
    output = [e for e in events if e["type"] in ("stdout", "stderr")]
    assert texts(output, "stdout") == "one\né\nthree\n"
    assert "\ufffd" not in texts(output, "stdout")
    order = [(e["type"], e["text"]) for e in output if e["text"].strip()]
    assert order.index(("stdout", "one\n")) < order.index(("stderr", "two\n"))
    quiet = events.index(next(e for e in events if e["type"] == "keepalive"))
    assert quiet < events.index(next(e for e in output if "three" in e["text"]))


def test_closing_a_streamed_command_kills_it(api: httpx.Client, session_id: str) -> None:
    with api.stream(
        "POST",
        f"/v1/sessions/{session_id}/commands/stream",
        json={"command": "echo started; sleep 300"},
    ) as r:
        events = lines_of(r)
        start = next(events)
        assert start["type"] == "start"
        assert next(events) == {"type": "stdout", "text": "started\n"}
    ended = wait_until_ended(api, session_id, start["pid"])
    assert ended["end"]["exit_code"] != 0


def test_a_caller_that_leaves_a_whole_command_kills_it(
    server: Server, api: httpx.Client, session_id: str
) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with (
        httpx.Client(base_url=server.url, headers=headers, timeout=3) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post(
            f"/v1/sessions/{session_id}/commands",
            json={"argv": ["sleep", "300"], "tag": "left-behind"},
        )
    pid = tagged(api, session_id, "left-behind")["pid"]
    assert wait_until_ended(api, session_id, pid)["end"]["exit_code"] != 0


# --- background processes
def test_a_background_process_takes_stdin_streams_output_and_is_waited_for(
    api: httpx.Client, session_id: str
) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    started = api.post(base, json={"argv": ["cat"], "stdin": True, "tag": "echoer"})
    assert started.status_code == 201, started.text
    info = started.json()
    pid = info["pid"]
    assert info["running"] is True and info["argv"] == ["cat"] and info["tag"] == "echoer"
    assert pid in [p["pid"] for p in api.get(base).json()]
    assert api.get(f"{base}/{pid}").json()["running"] is True
    sent = api.post(
        f"{base}/{pid}/stdin",
        content=b"hello\n",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert sent.status_code == 204, sent.text
    # Reconnecting with replay gives what it wrote before; closing the stream leaves it running.
    with api.stream("GET", f"{base}/{pid}/output", params={"replay": True}) as r:
        assert r.status_code == 200
        assert next(lines_of(r)) == {"type": "stdout", "text": "hello\n"}
    assert api.get(f"{base}/{pid}").json()["running"] is True
    assert api.post(f"{base}/{pid}/stdin/close").status_code == 204
    waited = api.post(f"{base}/{pid}/wait")
    assert waited.status_code == 200, waited.text
    assert (waited.json()["exit_code"], waited.json()["stdout"]) == (0, "hello\n")
    assert pid not in [p["pid"] for p in api.get(base).json()]
    ended = process_of(api, session_id, pid)
    assert ended["running"] is False and ended["end"]["exit_code"] == 0


def test_stdin_with_no_content_type_is_taken_raw(api: httpx.Client, session_id: str) -> None:
    """Input is bytes, whatever they look like: not parsed (or refused) as deep JSON."""
    base = f"/v1/sessions/{session_id}/processes"
    pid = api.post(base, json={"argv": ["cat"], "stdin": True}).json()["pid"]
    looks_like_json = b"[" * 1000
    request = api.build_request("POST", f"{base}/{pid}/stdin", content=looks_like_json)
    assert "content-type" not in request.headers
    assert api.send(request).status_code == 204  # was 400 JsonTooDeep
    assert api.post(f"{base}/{pid}/stdin/close").status_code == 204
    assert api.post(f"{base}/{pid}/wait").json()["stdout"] == looks_like_json.decode()


def test_following_output_ends_with_the_result(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    pid = api.post(base, json={"command": "read go; echo done", "stdin": True}).json()["pid"]
    with api.stream("GET", f"{base}/{pid}/output") as r:
        events = lines_of(r)
        api.post(f"{base}/{pid}/stdin", content=b"\n")
        got = list(events)
    assert got[-1]["type"] == "end" and got[-1]["result"]["stdout"] == "done\n"
    assert texts(got, "stdout") == "done\n"


def test_signals_by_name_or_number_and_only_those_allowed(
    api: httpx.Client, session_id: str
) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    pid = api.post(base, json={"argv": ["sleep", "300"]}).json()["pid"]
    for refused in ("SIGSEGV", "SIGQUIT", 11, "nonsense", 0):
        r = api.post(f"{base}/{pid}/signal", json={"signal": refused})
        assert r.status_code == 400, (refused, r.text)
        error = r.json()["error"]
        assert error["type"] == "SignalNotAllowed" and "SIGTERM" in error["message"]
    assert api.get(f"{base}/{pid}").json()["running"] is True
    assert api.post(f"{base}/{pid}/signal", json={"signal": 15}).status_code == 204
    result = api.post(f"{base}/{pid}/wait").json()
    assert result["signal"] == 15 or result["exit_code"] == 128 + 15, result


def test_a_stopped_and_continued_process_can_still_be_ended(
    api: httpx.Client, session_id: str
) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    pid = api.post(base, json={"argv": ["sleep", "300"]}).json()["pid"]
    assert api.post(f"{base}/{pid}/signal", json={"signal": "SIGSTOP"}).status_code == 204
    assert api.post(f"{base}/{pid}/signal", json={"signal": "CONT"}).status_code == 204
    assert api.post(f"{base}/{pid}/signal", json={"signal": "TERM"}).status_code == 204
    ended = wait_until_ended(api, session_id, pid)["end"]
    assert ended["signal"] == 15 or ended["exit_code"] == 128 + 15, ended


def test_a_terminal_process_is_resized(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    info = api.post(
        base,
        json={"command": "read go; stty size", "terminal": {"cols": 80, "rows": 24}},
    ).json()
    assert info["terminal"] is True
    resized = api.post(f"{base}/{info['pid']}/resize", json={"cols": 132, "rows": 43})
    assert resized.status_code == 204, resized.text
    api.post(f"{base}/{info['pid']}/stdin", content=b"\n")
    result = api.post(f"{base}/{info['pid']}/wait").json()
    assert "43 132" in result["stdout"], result
    bad = api.post(f"{base}/{info['pid']}/resize", json={"cols": 0, "rows": 10})
    assert bad.status_code == 422


def test_a_wrong_pid_is_404(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/processes/999999"
    for method, path, kwargs in [
        ("GET", "", {}),
        ("GET", "/output", {}),
        ("POST", "/stdin", {"content": b"x"}),
        ("POST", "/stdin/close", {}),
        ("POST", "/signal", {"json": {"signal": "SIGTERM"}}),
        ("POST", "/wait", {}),
        ("POST", "/resize", {"json": {"cols": 80, "rows": 24}}),
    ]:
        r = api.request(method, base + path, **kwargs)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["type"] == "ProcessNotFound", r.text


def test_stdin_over_the_request_limit_is_413(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/processes"
    pid = api.post(base, json={"argv": ["cat"], "stdin": True}).json()["pid"]
    r = api.post(
        f"{base}/{pid}/stdin",
        content=b"x" * (MAX_REQUEST_BYTES + 1),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "TooLarge"
    api.post(f"{base}/{pid}/signal", json={"signal": "SIGKILL"})


def test_another_keys_session_is_404_for_every_process_route(
    server: Server, session_id: str
) -> None:
    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        pid = a.post(f"/v1/sessions/{session_id}/processes", json={"argv": ["sleep", "300"]})
        pid = pid.json()["pid"]
        base = f"/v1/sessions/{session_id}"
        for method, path, body in [
            ("POST", "/commands", {"command": "id"}),
            ("POST", "/commands/stream", {"command": "id"}),
            ("POST", "/processes", {"command": "id"}),
            ("GET", "/processes", None),
            ("GET", f"/processes/{pid}", None),
            ("GET", f"/processes/{pid}/output", None),
            ("POST", f"/processes/{pid}/signal", {"signal": "SIGKILL"}),
            ("POST", f"/processes/{pid}/wait", None),
        ]:
            r = b.request(method, base + path, json=body)
            assert r.status_code == 404, (method, path, r.text)
        assert a.get(f"{base}/processes/{pid}").json()["running"] is True
        with server.client(key=None) as anonymous:
            assert anonymous.post(f"{base}/commands", json={"command": "id"}).status_code == 401


# --- a terminal over a WebSocket
def ws_url(server: Server, session_id: str, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + f"/v1/sessions/{session_id}/terminal{query}"


def read_until(ws: ClientConnection, wanted: bytes, timeout_s: float = 60) -> bytes:
    """Terminal output until `wanted` appears (text frames are skipped)."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        frame = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(frame, bytes):
            seen += frame
    return seen


def closing_frames(ws: ClientConnection, timeout_s: float = 30) -> tuple[list[Any], int | None]:
    """Every text frame until the server closes; and its close code."""
    frames = []
    try:
        while True:
            frame = ws.recv(timeout=timeout_s)
            if isinstance(frame, str):
                frames.append(json.loads(frame))
    except ConnectionClosed as closed:
        return frames, closed.rcvd.code if closed.rcvd else None


def test_a_terminal_runs_commands_resizes_and_ends(server: Server, session_id: str) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with connect(ws_url(server, session_id, "?cols=90&rows=30"), additional_headers=headers) as ws:
        ws.send(b"echo $((6*7))\n")
        read_until(ws, b"42")
        ws.send(b"stty size\n")
        read_until(ws, b"30 90")
        ws.send(json.dumps({"type": "resize", "cols": 123, "rows": 45}))
        ws.send(b"stty size\n")
        read_until(ws, b"45 123")
        ws.send('{"type": "resize", "cols": 0}')  # a bad control message: told, not fatal
        ws.send(b"exit 7\n")
        frames, code = closing_frames(ws)
    assert code == 1000
    assert frames[0]["type"] == "error" and "cols" in frames[0]["error"]["message"]
    assert frames[-1]["type"] == "end" and frames[-1]["exit_code"] == 7


def test_a_terminal_authenticates_by_first_frame_and_dies_with_its_socket(
    server: Server, api: httpx.Client, session_id: str
) -> None:
    with connect(ws_url(server, session_id)) as ws:
        ws.send(json.dumps({"type": "auth", "key": KEY_A}))
        ws.send(b"echo $((6*7))\n")
        read_until(ws, b"42")
    terminal = tagged(api, session_id, "terminal")
    ended = wait_until_ended(api, session_id, terminal["pid"])
    assert ended["terminal"] is True and ended["end"]["exit_code"] != 0


def test_a_terminal_client_that_does_not_read_misses_output_instead_of_queueing_it(
    server: Server, session_id: str
) -> None:
    """What one socket may queue is bounded: a flood it does not read is dropped (and it is
    told), and the terminal carries on."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    # A small receive buffer (no autotuning) and no compression (the flood is one repeated
    # byte): what the host's sockets hold is not the test.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    url = ws_url(server, session_id)
    with connect(url, sock=sock, compression=None, additional_headers=headers) as ws:
        ws.send(b"head -c 40000000 /dev/zero | tr '\\0' x\n")
        time.sleep(8)  # not reading while the flood is written
        told = []
        deadline = time.monotonic() + 120
        with contextlib.suppress(TimeoutError):  # read what was kept, until all is quiet
            while time.monotonic() < deadline:
                frame = ws.recv(timeout=3)
                if isinstance(frame, str):
                    told.append(json.loads(frame))
        # The next output comes after word of what was missed; the terminal carries on.
        ws.send(b"echo AFTER-$((1+1))\n")
        seen = b""
        while b"AFTER-2" not in seen:
            frame = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(frame, str):
                told.append(json.loads(frame))
            else:
                seen = seen[-64:] + frame
    assert told and told[0]["type"] == "dropped" and told[0]["bytes"] > 0, told


@pytest.mark.parametrize(
    ("headers", "first_frame", "code"),
    [
        ({}, '{"type": "auth", "key": "wrong"}', 4401),
        ({}, "echo hi", 4401),
        ({"Authorization": "Bearer wrong"}, None, 4401),
        ({"Authorization": f"Basic {KEY_A}"}, None, 4401),
        ({"Authorization": f"Bearer {KEY_B}"}, None, 4404),
    ],
)
def test_a_terminal_is_refused_without_the_owners_key(
    server: Server,
    session_id: str,
    headers: dict[str, str],
    first_frame: str | None,
    code: int,
) -> None:
    with connect(ws_url(server, session_id), additional_headers=headers) as ws:
        if first_frame is not None:
            ws.send(first_frame)
        frames, closed_with = closing_frames(ws)
    assert closed_with == code
    assert frames and frames[0]["type"] == "error", frames


def test_a_terminal_of_an_impossible_size_is_refused(server: Server, session_id: str) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server, session_id, "?cols=0&rows=24"), additional_headers=headers)
    assert refused.value.response.status_code == 403


def test_a_silent_unauthenticated_socket_is_closed(server: Server, session_id: str) -> None:
    with connect(ws_url(server, session_id)) as ws:
        frames, code = closing_frames(ws, timeout_s=30)
    assert code == 4401
    assert "auth" in frames[0]["error"]["message"]


def test_processes_are_in_the_openapi_schema(api: httpx.Client, session_id: str) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    base = "/v1/sessions/{session_id}"
    for path in [
        "/commands",
        "/commands/stream",
        "/processes",
        "/processes/{pid}",
        "/processes/{pid}/output",
        "/processes/{pid}/stdin",
        "/processes/{pid}/stdin/close",
        "/processes/{pid}/signal",
        "/processes/{pid}/wait",
        "/processes/{pid}/resize",
        "/terminal",
    ]:
        assert base + path in paths, path
        assert all(op.get("summary") for op in paths[base + path].values()), path
    assert "WebSocket" in paths[base + "/terminal"]["get"]["description"]
    stdin_body = paths[base + "/processes/{pid}/stdin"]["post"]["requestBody"]
    assert "application/octet-stream" in stdin_body["content"]
    plain = api.get(f"/v1/sessions/{session_id}/terminal")
    assert plain.status_code == 426


# --- the HTTP client
def test_the_client_runs_streams_and_manages_processes(server: Server, session_id: str) -> None:
    with Client(server.url, api_key=KEY_A) as client:
        result = client.run_command(session_id, command="echo $((2+3))")
        assert (result.exit_code, result.stdout) == (0, "5\n")
        events = list(client.run_command_stream(session_id, argv=["sh", "-c", "echo a; echo b"]))
        assert events[0]["type"] == "start" and events[-1]["type"] == "end"
        assert texts(events, "stdout") == "a\nb\n"
        info = client.start_process(session_id, argv=["cat"], stdin=True)
        assert info.pid in [p.pid for p in client.list_processes(session_id)]
        client.send_stdin(session_id, info.pid, "typed\n")
        followed = client.process_output(session_id, info.pid, replay=True)
        assert next(followed) == {"type": "stdout", "text": "typed\n"}
        followed.close()  # leaves it running
        assert client.process_info(session_id, info.pid).running
        client.close_stdin(session_id, info.pid)
        assert client.wait_process(session_id, info.pid).stdout == "typed\n"
        sleeper = client.start_process(session_id, argv=["sleep", "300"])
        with pytest.raises(APIError) as refused:
            client.signal_process(session_id, sleeper.pid, "SIGSEGV")
        assert refused.value.status == 400
        client.signal_process(session_id, sleeper.pid, "SIGKILL")
        assert client.wait_process(session_id, sleeper.pid).signal == 9
        shell = client.start_process(
            session_id, command="read go; stty size", terminal={"cols": 80, "rows": 24}
        )
        client.resize_terminal(session_id, shell.pid, 100, 50)
        client.send_stdin(session_id, shell.pid, b"\n")
        assert "50 100" in client.wait_process(session_id, shell.pid).stdout
        with pytest.raises(APIError) as missing:
            client.process_info(session_id, 999999)
        assert (missing.value.status, missing.value.kind) == (404, "ProcessNotFound")


def test_leaving_a_client_stream_early_kills_the_command(
    server: Server, api: httpx.Client, session_id: str
) -> None:
    with Client(server.url, api_key=KEY_A) as client:
        events = client.run_command_stream(session_id, command="echo up; sleep 300")
        start = next(events)
        assert next(events) == {"type": "stdout", "text": "up\n"}
        events.close()
    assert wait_until_ended(api, session_id, start["pid"])["end"]["exit_code"] != 0
