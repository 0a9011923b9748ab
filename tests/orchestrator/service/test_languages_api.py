"""`language` on the sessions API: execute, stream and restart in another language's kernel,
what a session and the deployment say they have, and a language there is not refused with a
400 naming those there are. On a real `code-interpreter serve`, every usable backend."""

from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import pytest

from tests.conftest import require_backend
from tests.orchestrator.service.conftest import leftovers, make_server, service_backends

R_ON_LOCAL = pytest.mark.skipif("local" not in service_backends(), reason="R runs on the host")


def execute(api: httpx.Client, sid: str, code: str, **fields: object) -> httpx.Response:
    return api.post(f"/v1/sessions/{sid}/execute", json={"code": code, **fields})


def test_bash_cells_keep_their_state_and_the_record_says_the_language(
    api: httpx.Client, session_id: str
) -> None:
    before = api.get(f"/v1/sessions/{session_id}").json()
    assert before["languages"][0] == "python" and "bash" in before["languages"]
    assert before["started_languages"] == ["python"]  # bash's kernel starts on first use

    first = execute(api, session_id, "ANSWER=41", language="bash")
    assert first.status_code == 200, first.text
    assert first.json()["language"] == "bash"
    second = execute(api, session_id, "echo $((ANSWER + 1))", language="sh")  # an alias
    assert second.status_code == 200, second.text
    assert second.json()["stdout"] == "42\n" and second.json()["status"] == "ok"
    python = execute(api, session_id, "'ANSWER' in globals()").json()
    assert python["results"][0]["text"] == "False" and python["language"] == "python"

    after = api.get(f"/v1/sessions/{session_id}").json()
    assert set(after["started_languages"]) == {"python", "bash"}


def test_a_bash_error_and_a_streamed_bash_cell(api: httpx.Client, session_id: str) -> None:
    failed = execute(api, session_id, "echo before; false", language="bash").json()
    assert failed["status"] == "error" and failed["stdout"].startswith("before")
    url = f"/v1/sessions/{session_id}/execute/stream"
    body = {"code": "for i in 1 2 3; do echo line$i; done", "language": "bash"}
    with api.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = [json.loads(line) for line in response.iter_lines() if line]
    done = lines[-1]
    assert done["type"] == "done" and done["execution"]["language"] == "bash"
    streamed = "".join(line["text"] for line in lines if line["type"] == "stdout")
    assert streamed == "line1\nline2\nline3\n"


def test_restart_one_language_keeps_the_others(api: httpx.Client, session_id: str) -> None:
    execute(api, session_id, "kept = 1")
    execute(api, session_id, "GONE=1", language="bash")
    restarted = api.post(f"/v1/sessions/{session_id}/restart", json={"language": "bash"})
    assert restarted.status_code == 200, restarted.text
    assert execute(api, session_id, 'echo "[${GONE:-unset}]"', language="bash").json()[
        "stdout"
    ] == ("[unset]\n")
    assert execute(api, session_id, "kept").json()["results"][0]["text"] == "1"
    everything = api.post(f"/v1/sessions/{session_id}/restart")  # no body: every kernel
    assert everything.status_code == 200
    assert execute(api, session_id, "'kept' in globals()").json()["results"][0]["text"] == "False"


@pytest.mark.parametrize("route", ["execute", "execute/stream", "restart"])
def test_an_unknown_language_is_a_400_naming_the_languages(
    api: httpx.Client, session_id: str, route: str
) -> None:
    r = api.post(f"/v1/sessions/{session_id}/{route}", json={"code": "1", "language": "cobol"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "UnknownLanguage"
    for name in ("'cobol'", "python", "bash", "r", "javascript"):
        assert name in error["message"], error
    too_long = api.post(
        f"/v1/sessions/{session_id}/{route}", json={"code": "1", "language": "x" * 5000}
    )
    # A name no language could have is refused by the request's schema, as other fields are.
    assert too_long.status_code == 422 and "language" in too_long.json()["error"]["message"]
    assert "x" * 100 not in too_long.text


def test_a_language_the_image_lacks_is_a_400_naming_what_it_has(api: httpx.Client) -> None:
    """The default Docker image has Python and Bash only: R is refused, not tried."""
    if "docker" not in service_backends():
        pytest.skip("needs the docker backend")
    created = api.post("/v1/sessions", json={"backend": "docker"})
    sid = created.json()["id"]
    try:
        assert created.json()["languages"] == ["python", "bash"]
        r = execute(api, sid, "1 + 1", language="r")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "LanguageUnavailable"
        assert "'r'" in error["message"] and "python, bash" in error["message"]
    finally:
        api.delete(f"/v1/sessions/{sid}")


@R_ON_LOCAL
def test_python_and_r_share_the_workspace_and_r_shows_a_data_frame(api: httpx.Client) -> None:
    sid = api.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    try:
        wrote = execute(
            api, sid, "import pandas as pd\npd.DataFrame({'a': [1, 2, 3]}).to_csv('t.csv')"
        )
        assert wrote.json()["status"] == "ok", wrote.text
        read = execute(api, sid, "d <- read.csv('t.csv'); sum(d$a)", language="R").json()
        assert read["status"] == "ok", read
        assert read["results"][0]["text"] == "[1] 6"
        frame = execute(api, sid, "data.frame(x = 1:2, y = c('p', 'q'))", language="r").json()
        [result] = frame["results"]
        assert result["html"] and re.search(r"1\s+1\s+p", result["text"]), result
        failed = execute(api, sid, "stop('no such thing')", language="r").json()
        assert failed["status"] == "error" and "no such thing" in failed["error"]["value"]
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_the_deployment_says_its_languages(api: httpx.Client) -> None:
    r = api.get("/v1/languages")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["languages"] == body["backends"][body["default_backend"]]
    assert set(body["backends"]) == set(service_backends())
    for languages in body["backends"].values():
        assert languages[0] == "python" and "bash" in languages
    if "docker" in body["backends"]:
        assert body["backends"]["docker"] == ["python", "bash"]  # the default image's label
    assert "js" in body["aliases"]["javascript"]
    assert httpx.get(f"{api.base_url}/v1/languages").status_code == 401  # behind a key


def test_metrics_count_executions_per_language(api: httpx.Client, session_id: str) -> None:
    execute(api, session_id, "echo counted", language="bash")
    text = api.get("/metrics").text
    counted = [
        line
        for line in text.splitlines()
        if line.startswith("cir_executions_total{") and 'language="bash"' in line
    ]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, text


FULL_IMAGE = "code-interpreter-kernel-full:latest"


def test_the_full_docker_image_runs_r_and_typescript_through_the_api() -> None:
    """A session on the full image has every language; its tool definition lists them."""
    require_backend("docker")
    import docker
    from docker.errors import ImageNotFound

    try:
        docker.from_env().images.get(FULL_IMAGE)
    except ImageNotFound:
        if os.environ.get("CI"):
            pytest.fail(f"{FULL_IMAGE} must be built in CI (make image)")
        pytest.skip(f"{FULL_IMAGE} is not built here")
    server = make_server(
        backends="docker",
        default_backend="docker",
        docker_images=f"code-interpreter-kernel:latest,{FULL_IMAGE}",
    ).start()
    try:
        with server.client() as api:
            created = api.post("/v1/sessions", json={"image": FULL_IMAGE})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            assert set(created.json()["languages"]) == {
                "python", "bash", "javascript", "typescript", "r", "java"
            }  # fmt: skip
            r = execute(api, sid, "v <- c(3, 4); sqrt(sum(v^2))", language="r").json()
            assert r["status"] == "ok" and r["results"][0]["text"] == "[1] 5", r
            js = execute(api, sid, "const n: number = 6; console.log(n * 7)", language="ts")
            assert js.json()["stdout"] == "42\n", js.text
            tool = api.get("/v1/tools/code_interpreter", params={"session_id": sid}).json()
            assert "r" in tool["json_schema"]["properties"]["language"]["enum"]
            api.delete(f"/v1/sessions/{sid}")
    finally:
        server.stop()
        assert leftovers(server) == []
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)
