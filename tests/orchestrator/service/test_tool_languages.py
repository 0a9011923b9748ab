"""The `code_interpreter` tool in other languages, over the invoke route of a real service: the
description and schema list the languages the deployment has, a cell runs in each, and a
language there is not is a tool error the model can fix (naming those there are)."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.orchestrator.service.conftest import service_backends


def invoke(api: httpx.Client, arguments: object, fmt: str = "openai_chat") -> dict:  # type: ignore[type-arg]
    r = api.post(
        "/v1/tools/code_interpreter/invoke",
        json={"arguments": arguments, "format": fmt, "call_id": "call-1"},
    )
    assert r.status_code == 200, r.text
    result: dict = r.json()  # type: ignore[type-arg]
    return result


def test_the_description_and_schema_list_the_deployments_languages(api: httpx.Client) -> None:
    wanted = api.get("/v1/languages").json()["languages"]  # the default backend's
    defs = api.get("/v1/tools/code_interpreter").json()
    language = defs["json_schema"]["properties"]["language"]
    assert language["enum"] == wanted and language["type"] == "string"
    assert "language" not in defs["json_schema"]["required"]
    text = defs["openai_chat"]["function"]["description"]
    others = [name for name in wanted if name != "python"]
    assert f"set language to one of {', '.join(others)}" in text


def test_a_bash_cell_keeps_its_state_beside_python(api: httpx.Client) -> None:
    first = invoke(api, {"code": "COUNT=20", "language": "bash"})
    sid = first["session_id"]
    try:
        assert first["status"] == "ok", first
        second = invoke(
            api, {"code": "echo $((COUNT * 2 + 2))", "language": "bash", "session_id": sid}
        )
        content = second["output"]["content"]
        assert "[stdout]\n42" in content and " · bash · " in content, content
        failed = invoke(api, {"code": "ls /no/such/dir", "language": "bash", "session_id": sid})
        assert failed["status"] == "error"
        assert "[error] exit status 2" in failed["output"]["content"], failed
        python = invoke(api, {"code": "6 * 7", "session_id": sid})
        assert "[result]\n42" in python["output"]["content"]
        assert " · bash · " not in python["output"]["content"]
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_an_r_data_frame_reads_as_plain_text(api: httpx.Client) -> None:
    if "r" not in api.get("/v1/languages").json()["languages"]:
        if os.environ.get("CI"):  # CI installs R for the local backend: it must run there
            pytest.fail("the default backend has no R")
        pytest.skip("the default backend has no R")
    out = invoke(api, {"code": "data.frame(n = c(10, 20), s = c('a', 'b'))", "language": "r"})
    try:
        content = out["output"]["content"]
        assert out["status"] == "ok" and "[display]" in content, content  # IRkernel displays
        assert "<table" not in content and "10 a" in " ".join(content.split()), content
    finally:
        api.delete(f"/v1/sessions/{out['session_id']}")


def test_an_unknown_language_is_a_fixable_error_and_starts_no_session(api: httpx.Client) -> None:
    before = {s["id"] for s in api.get("/v1/sessions").json()}
    out = invoke(api, {"code": "1", "language": "cobol"}, "anthropic")
    assert out["status"] == "invalid_call" and out["session_id"] is None
    [text] = out["output"]["content"]
    assert out["output"]["is_error"] is True
    for name in ("'cobol'", "python", "bash", "Omit language"):
        assert name in text["text"], text
    assert {s["id"] for s in api.get("/v1/sessions").json()} == before


def test_a_language_the_session_lacks_is_a_fixable_error(api: httpx.Client) -> None:
    """The default Docker image has Python and Bash: R there is told, naming those two."""
    if "docker" not in service_backends():
        return
    sid = api.post("/v1/sessions", json={"backend": "docker"}).json()["id"]
    try:
        out = invoke(api, {"code": "1", "language": "r", "session_id": sid})
        assert out["status"] == "invalid_call" and out["session_id"] == sid
        assert "'r' is not installed" in out["output"]["content"]
        assert "python, bash" in out["output"]["content"]
        defs = api.get("/v1/tools/code_interpreter", params={"session_id": sid}).json()
        assert defs["json_schema"]["properties"]["language"]["enum"] == ["python", "bash"]
    finally:
        api.delete(f"/v1/sessions/{sid}")
