"""What the HTTP front tells, and to whom: liveness only to anyone, the rest behind a key; every
string that reaches a kernel is valid Unicode or refused with 422; what a sandbox made is served
so that a browser shows it and never runs it."""

from __future__ import annotations

import hashlib
import json

import httpx

from tests.orchestrator.service.conftest import KEY_B, Server

LONE = "\udc80"  # httpx sends it as the JSON escape "\udc80", as any client may


def test_health_says_only_that_the_service_lives(server: Server) -> None:
    with server.client(key=None) as anonymous:
        health = anonymous.get("/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert anonymous.get("/v1/status").status_code == 401
        metrics = anonymous.get("/metrics")
        assert metrics.status_code == 401 and "cir_" not in metrics.text
        assert server.client(key="wrong").get("/metrics").status_code == 401


def test_status_and_metrics_need_a_key(api: httpx.Client, session_id: str) -> None:
    status = api.get("/v1/status").json()
    assert status["sessions"] >= 1 and status["backends"] and "pools" in status
    metrics = api.get("/metrics")
    assert metrics.status_code == 200 and "cir_sessions_active" in metrics.text


def test_status_counts_only_the_callers_sessions(server: Server, session_id: str) -> None:
    with server.client(KEY_B) as other:
        assert other.get("/v1/status").json()["sessions"] == len(other.get("/v1/sessions").json())


def test_lone_surrogates_are_refused_where_they_would_reach_the_kernel(
    api: httpx.Client, session_id: str
) -> None:
    execute = f"/v1/sessions/{session_id}/execute"
    bodies = [
        (execute, {"code": f"x = '{LONE}'"}, "code"),
        (execute, {"code": "1", "cwd": f"d{LONE}"}, "cwd"),
        (execute, {"code": "1", "env": {"A": LONE}}, "env.A"),
        (execute + "/stream", {"code": f"'{LONE}'"}, "code"),
        ("/v1/sessions", {"env": {"A": f"v{LONE}"}}, "env.A"),
    ]
    for path, body, where in bodies:
        r = api.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "InvalidRequest" and where in error["message"], error
        assert "surrogate" in error["message"]
    # Well-formed text of any plane still runs.
    ok = api.post(execute, json={"code": "'é😀'"})
    assert ok.status_code == 200 and ok.json()["results"][0]["text"] == "'é😀'"


def test_lone_surrogates_are_refused_on_e2bs_execute(server: Server) -> None:
    with server.client(key=None) as http:
        made = http.post(
            "/v2/sandboxes",
            json={"templateID": "base"},
            headers={"X-API-Key": server.env["CODE_INTERPRETER_API_KEYS"].split(",")[0]},
        )
        assert made.status_code == 201, made.text
        sandbox = made.json()
        reach = {
            "E2b-Sandbox-Id": sandbox["sandboxID"],
            "X-Access-Token": sandbox["envdAccessToken"],
        }
        try:
            body = json.dumps({"code": f"'{LONE}'"})
            reach["content-type"] = "application/json"
            r = http.post("/execute", content=body, headers=reach)
            assert r.status_code == 400 and "surrogate" in r.json()["message"], r.text
        finally:
            key = {"X-API-Key": server.env["CODE_INTERPRETER_API_KEYS"].split(",")[0]}
            http.delete(f"/sandboxes/{sandbox['sandboxID']}", headers=key)


SVG = (
    "from IPython.display import SVG, display\n"
    'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script>'
    '<rect width="5" height="5"/></svg>\'))'
)


def test_svg_artifacts_are_shown_never_run(api: httpx.Client, session_id: str) -> None:
    run = api.post(f"/v1/sessions/{session_id}/execute", json={"code": SVG}).json()
    [result] = run["results"]
    artifact_id = hashlib.sha256(result["svg"].encode()).hexdigest()[:24]  # content-derived
    served = api.get(f"/v1/sessions/{session_id}/artifacts/{artifact_id}")
    assert served.status_code == 200 and b"<svg" in served.content
    assert served.headers["content-type"].startswith("image/svg+xml")
    policy = served.headers["content-security-policy"]
    assert policy == "default-src 'none'; style-src 'unsafe-inline'; sandbox"
    assert served.headers["x-content-type-options"] == "nosniff"


def test_every_answer_says_nosniff(server: Server, api: httpx.Client) -> None:
    answers = [
        api.get("/healthz"),
        api.get("/v1/sessions"),
        api.get("/v1/sessions/s-missing"),
        server.client(key=None).get("/v1/sessions"),
        api.post(
            "/v1/sessions/s-x/execute",
            content=b"[" * 100 + b"]" * 100,
            headers={"content-type": "application/json"},
        ),
    ]
    for answer in answers:
        assert answer.headers.get("x-content-type-options") == "nosniff", answer.request.url
