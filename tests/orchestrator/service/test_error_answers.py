"""Errors over /v1: what was meant to be missing is a typed 404; a bug is a logged 500.

A `KeyError` from a bug anywhere once answered a polite "not found" and was never logged; every
intended not-found is now a typed error that names itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import Settings


async def test_a_key_error_from_a_bug_is_a_logged_500(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(Settings(api_keys=["k"], state_dir=tmp_path / "state"))

    @app.get("/v1/buggy")
    async def buggy() -> dict[str, str]:
        return {}["missing"]  # type: ignore[return-value]  # the bug under test

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        with caplog.at_level(logging.ERROR, logger="orchestrator.app"):
            r = await client.get("/v1/buggy", headers={"Authorization": "Bearer k"})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "InternalError"
    logged = [rec for rec in caplog.records if rec.name == "orchestrator.app"]
    assert logged, "the bug was not logged"
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is KeyError


def test_an_unknown_execution_is_a_typed_404(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/executions"
    for path in (f"{base}/e-0000000000000000", f"{base}/e-0000000000000000/stdout", f"{base}/x"):
        r = api.get(path)
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "OutputNotFound", (path, error)
        assert "execution" in error["message"], (path, error)


def test_an_unknown_artifact_is_a_typed_404(api: httpx.Client, session_id: str) -> None:
    for artifact_id in ("a-0000000000000000", "not-an-id"):
        r = api.get(f"/v1/sessions/{session_id}/artifacts/{artifact_id}")
        assert r.status_code == 404, (artifact_id, r.text)
        error = r.json()["error"]
        assert error["type"] == "OutputNotFound", (artifact_id, error)
        assert artifact_id in error["message"], (artifact_id, error)


def test_a_stream_other_than_stdout_or_stderr_is_a_typed_404(
    api: httpx.Client, session_id: str
) -> None:
    ran = api.post(f"/v1/sessions/{session_id}/execute", json={"code": "print('hi')"})
    assert ran.status_code == 200, ran.text
    execution_id = ran.json()["execution_id"]
    base = f"/v1/sessions/{session_id}/executions/{execution_id}"
    assert api.get(f"{base}/stdout").text == "hi\n"
    r = api.get(f"{base}/results")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "OutputNotFound", error
    assert "stdout" in error["message"] and "stderr" in error["message"], error
