"""Sessions and executions over HTTP: auth, ownership, execute, stream, disconnects, control."""

from __future__ import annotations

import importlib.metadata
import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.http_client import APIError, AsyncClient, Client
from code_interpreter_wire.rest import ExecutionRecord
from code_interpreter_wire.results import OutputEvent, StdoutEvent
from orchestrator.release import DISTRIBUTION
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server


def test_health_and_openapi(api: httpx.Client) -> None:
    health = api.get("/healthz").json()
    assert health["status"] == "ok"
    spec = api.get("/openapi.json").json()
    assert "/v1/sessions/{session_id}/execute" in spec["paths"]
    assert "/v1/tools/code_interpreter/invoke" in spec["paths"]
    assert spec["info"]["version"] == importlib.metadata.version(DISTRIBUTION)


def test_auth_is_required_and_checked(server: Server) -> None:
    with server.client(key=None) as anonymous:
        r = anonymous.get("/v1/sessions")
        assert r.status_code == 401
        assert r.json()["error"]["message"].startswith("missing API key")
    with server.client(key="wrong") as wrong:
        assert wrong.post("/v1/sessions", json={}).status_code == 401
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Basic {KEY_A}"}) as basic:
        assert basic.get("/v1/sessions").status_code == 401


def test_a_key_cannot_see_or_touch_another_keys_session(server: Server, session_id: str) -> None:
    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        assert session_id in [s["id"] for s in a.get("/v1/sessions").json()]
        assert session_id not in [s["id"] for s in b.get("/v1/sessions").json()]
        for method, path, body in [
            ("GET", "", None),
            ("POST", "/execute", {"code": "1"}),
            ("POST", "/interrupt", None),
            ("POST", "/restart", None),
            ("GET", "/files", None),
            ("DELETE", "", None),
        ]:
            r = b.request(method, f"/v1/sessions/{session_id}{path}", json=body)
            assert r.status_code == 404, (method, path, r.text)
        invoked = b.post(
            "/v1/tools/code_interpreter/invoke",
            json={"arguments": {"code": "1", "session_id": session_id}, "call_id": "c1"},
        ).json()
        assert invoked["status"] == "session_error"
        assert a.get(f"/v1/sessions/{session_id}").status_code == 200  # still there


def test_execute_returns_the_whole_execution(api: httpx.Client, session_id: str) -> None:
    first = api.post(f"/v1/sessions/{session_id}/execute", json={"code": "x = 20\nprint('hi')"})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["status"] == "ok" and body["stdout"] == "hi\n"
    assert body["session_id"] == session_id and body["execution_id"].startswith("e-")
    second = api.post(f"/v1/sessions/{session_id}/execute", json={"code": "x + 1"}).json()
    assert second["results"][0]["text"] == "21"
    assert second["execution_count"] == 2
    kept = api.get(f"/v1/sessions/{session_id}/executions/{second['execution_id']}").json()
    assert kept["results"][0]["text"] == "21"
    failed = api.post(f"/v1/sessions/{session_id}/execute", json={"code": "1/0"}).json()
    assert failed["status"] == "error" and failed["error"]["name"] == "ZeroDivisionError"
    timed = api.post(
        f"/v1/sessions/{session_id}/execute",
        json={"code": "import time; time.sleep(30)", "timeout_s": 1},
    ).json()
    assert timed["status"] == "timeout"


def test_stream_sends_events_as_they_happen(api: httpx.Client, session_id: str) -> None:
    code = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.4)\n'end'"
    arrivals: list[tuple[float, dict[str, object]]] = []
    with api.stream(
        "POST", f"/v1/sessions/{session_id}/execute/stream", json={"code": code}
    ) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        for line in response.iter_lines():
            arrivals.append((time.monotonic(), json.loads(line)))
    events = [e for _, e in arrivals]
    assert [e["type"] for e in events] == ["stdout", "stdout", "stdout", "result", "done"]
    assert [e.get("text") for e in events[:3]] == ["0\n", "1\n", "2\n"]
    assert events[-1]["execution"]["stdout"] == "0\n1\n2\n"  # type: ignore[index]
    assert arrivals[-1][0] - arrivals[0][0] > 0.6  # the first line came before the end


def test_stream_keepalive_during_silence(server: Server) -> None:
    with server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        with api.stream(
            "POST",
            f"/v1/sessions/{sid}/execute/stream",
            json={"code": "import time; time.sleep(6)"},
        ) as response:
            kinds = [json.loads(line)["type"] for line in response.iter_lines()]
        assert kinds[0] == "keepalive" and kinds[-1] == "done"
        api.delete(f"/v1/sessions/{sid}")


def test_client_disconnect_interrupts_the_code(server: Server, session_id: str) -> None:
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)\nfinished = True"
    with server.client() as api:
        with api.stream(
            "POST", f"/v1/sessions/{session_id}/execute/stream", json={"code": code}
        ) as response:
            for line in response.iter_lines():
                assert json.loads(line)["type"] == "stdout"
                break  # leave mid-execution: the connection closes
        # A plain execute that the client abandons is interrupted too.
        with pytest.raises(httpx.ReadTimeout):
            api.post(
                f"/v1/sessions/{session_id}/execute",
                json={"code": "import time; time.sleep(60); finished = True"},
                timeout=2,
            )
        started = time.monotonic()
        after = api.post(
            f"/v1/sessions/{session_id}/execute",
            json={"code": "'finished' in globals()"},
            timeout=30,
        ).json()
        assert after["results"][0]["text"] == "False"
        assert time.monotonic() - started < 20  # not behind a 60 s sleep
        assert api.get(f"/v1/sessions/{session_id}").json()["busy"] is False


def wait_for(check: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    """Look at `check` until it holds (every 20 ms), or fail saying `what` never came."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not seen within {within_s:g} s"
        time.sleep(0.02)


def test_concurrent_executes_queue_in_order(server: Server, session_id: str) -> None:
    """Executes sent while the session is busy run in the order they came. The first holds
    the kernel until the test uploads `release`; each next one is sent only once the service
    counts the one before it among the session's calls in progress (taken, and queued for
    the kernel), so the arrival order is the test's, not a matter of timing."""
    base = f"/v1/sessions/{session_id}"
    hold = "import os, time\nwhile not os.path.exists('release'):\n    time.sleep(0.01)\n"
    with server.client() as api:
        api.post(f"{base}/execute", json={"code": "order = []"})
        outcomes: dict[int, str] = {}

        def call(i: int) -> None:
            with server.client() as own:
                code = (hold if i == 0 else "") + f"order.append({i}); {i}"
                r = own.post(f"{base}/execute", json={"code": code})
                outcomes[i] = r.json()["results"][0]["text"]

        def in_progress(count: int) -> Callable[[], bool]:
            return lambda: api.get(base).json()["calls_in_progress"] == count

        threads = []
        for i in range(4):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            wait_for(in_progress(i + 1), f"execute {i} taken by the service")
        released = api.post(f"{base}/files", files={"file": ("release", b"")})
        assert released.status_code == 201, released.text
        for t in threads:
            t.join()
        assert outcomes == {i: str(i) for i in range(4)}
        order = api.post(f"{base}/execute", json={"code": "order"}).json()
        assert order["results"][0]["text"] == "[0, 1, 2, 3]"
        assert api.get(base).json()["calls_in_progress"] == 0


def test_interrupt_restart_keepalive(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}"
    assert api.post(f"{base}/interrupt").json() == {"interrupted": False}
    outcome: dict[str, object] = {}

    def run() -> None:
        outcome["r"] = api.post(
            f"{base}/execute",
            json={"code": "import time; open('started', 'w').close(); time.sleep(60)"},
        ).json()

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: api.get(f"{base}/files/started").status_code == 200, "the code running")
    assert api.post(f"{base}/interrupt").json() == {"interrupted": True}
    t.join(timeout=30)
    assert outcome["r"]["status"] == "cancelled"  # type: ignore[index]
    api.post(f"{base}/execute", json={"code": "v = 1"})
    info = api.post(f"{base}/restart").json()
    assert info["id"] == session_id
    r = api.post(f"{base}/execute", json={"code": "'v' in globals()"}).json()
    assert r["results"][0]["text"] == "False"
    alive = api.post(f"{base}/keepalive").json()
    assert alive["idle_expires_in_s"] > 1000


def test_session_creation_options(api: httpx.Client) -> None:
    import base64

    created = api.post(
        "/v1/sessions",
        json={
            "env": {"GREETING": "hello"},
            "limits": {"memory_mb": 512},
            "files": [{"path": "in/data.txt", "content_base64": base64.b64encode(b"abc").decode()}],
        },
    )
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    assert created.json()["limits"]["memory_mb"] == 512
    assert created.json()["from_pool"] is False  # other limits than the pool's
    r = api.post(
        f"/v1/sessions/{sid}/execute",
        json={"code": "import os\n(os.environ['GREETING'], open('in/data.txt').read())"},
    ).json()
    assert r["results"][0]["text"] == "('hello', 'abc')", r
    api.delete(f"/v1/sessions/{sid}")
    too_much = api.post("/v1/sessions", json={"limits": {"memory_mb": 10**7}})
    assert too_much.status_code == 400 and "ceiling" in too_much.json()["error"]["message"]
    unknown = api.post("/v1/sessions", json={"backend": "vmware"})
    assert unknown.status_code == 400 and "not enabled" in unknown.json()["error"]["message"]
    deleted = api.get(f"/v1/sessions/{sid}")
    assert deleted.status_code == 410 and "deleted" in deleted.json()["error"]["message"]


def test_metrics_count_executions(api: httpx.Client, session_id: str) -> None:
    api.post(f"/v1/sessions/{session_id}/execute", json={"code": "1"})
    text = api.get("/metrics").text
    assert "cir_executions_total{" in text and 'status="ok"' in text
    assert "cir_sessions_active" in text and "cir_execution_seconds_bucket" in text


def test_python_clients(server: Server) -> None:
    with Client(server.url, KEY_A) as client:
        info = client.create_session()
        try:
            assert client.execute(info.id, "21 * 2").text == "42"
            events = list(client.execute_stream(info.id, "print('streamed')"))
            assert events[0] == {"type": "stdout", "text": "streamed\n"}
            client.upload(info.id, "f.txt", b"data")
            assert client.download(info.id, "f.txt") == b"data"
            assert [f.path for f in client.list_files(info.id)] == ["f.txt"]
        finally:
            client.delete_session(info.id)
        with pytest.raises(APIError) as caught:
            client.get_session(info.id)
        assert caught.value.status == 410


async def test_async_client(server: Server) -> None:
    async with AsyncClient(server.url, KEY_B) as client:
        info = await client.create_session()
        record = await client.execute(info.id, "import sys; sys.version_info[0]")
        assert record.text == "3" and record.session_id == info.id
        assert [s.id for s in await client.list_sessions()] == [info.id]
        await client.delete_session(info.id)


@pytest.mark.parametrize(
    "limits",
    [{"memory_mb": 0}, {"pids": 0}, {"cpus": -1}, {"tmp_size_mb": 0}, {"workspace_size_mb": 0}],
)
def test_limits_cannot_be_switched_off(api: httpx.Client, limits: dict[str, int]) -> None:
    r = api.post("/v1/sessions", json={"limits": limits})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "LimitTooHigh"
    nan = api.post(
        "/v1/sessions",
        content=b'{"limits": {"cpus": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert nan.status_code in (400, 422)


def test_bad_env_names_are_refused_and_leak_nothing(server: Server, api: httpx.Client) -> None:
    # The pool full first: a refill after an earlier test's hand-over (half a second later)
    # would add a sandbox's directory during this test.
    deadline = time.monotonic() + 60
    while api.get("/v1/status").json()["pools"].get("local", 0) < 1:
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.05)
    before = len(list((server.state_dir / "local").iterdir()))
    for env in ({"A=B": "1"}, {"": "1"}, {"OK": "nul\u0000byte"}):
        r = api.post("/v1/sessions", json={"env": env})
        assert r.status_code == 422, r.text
    assert api.post("/v1/sessions", json={"image": "someone-elses:image"}).status_code == 400
    time.sleep(0.5)
    assert len(list((server.state_dir / "local").iterdir())) == before


def test_a_stream_whose_session_is_deleted_ends_with_failure(server: Server) -> None:
    with server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        with api.stream(
            "POST",
            f"/v1/sessions/{sid}/execute/stream",
            json={"code": "import time; print('go', flush=True); time.sleep(30)"},
        ) as response:
            lines = response.iter_lines()
            events = [json.loads(next(lines))]
            with server.client() as other:  # deleted once its code is seen running
                assert other.delete(f"/v1/sessions/{sid}").status_code == 204
            events += [json.loads(line) for line in lines]
        assert events[0]["type"] == "stdout"
        assert events[-1]["type"] == "failure"
        assert "closed" in events[-1]["error"]["message"]


async def test_a_remote_code_session_streams_events_to_its_caller(server: Server) -> None:
    """`CodeSession.remote(...).execute(on_event=...)` follows the NDJSON stream: each output
    reaches the caller as it happens, and the whole record comes back at the end."""
    seen: list[str] = []

    async def sink(event: OutputEvent) -> None:
        if isinstance(event, StdoutEvent):
            seen.append(event.text)

    async with CodeSession.remote(server.url, KEY_A) as session:
        execution = await session.execute(
            "import time\nprint('a', flush=True)\ntime.sleep(0.5)\nprint('b')\n1/0",
            on_event=sink,
        )
    assert "".join(seen) == "a\nb\n" == execution.stdout
    assert execution.status == "error" and execution.error is not None
    assert isinstance(execution, ExecutionRecord)
