"""Which routes take which bodies, read off the real app: uploads are recognised by their exact
routes (a path that merely ends in `/files` used to get the 100 MiB upload limit before any key
was checked), and every route that takes a body checks its caller's key before the body is
read, but for the few the request guard reads (at most 64 KiB) without one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI

from orchestrator.app import create_app
from orchestrator.body_limit import is_upload
from orchestrator.config import Settings
from orchestrator.request_guard import Family, RequestGuard

pytestmark = pytest.mark.unit

_CHECKED = {
    Family.BEARER,
    Family.E2B_CONTROL,
    Family.E2B_DATA,
    Family.E2B_VOLUME,
    Family.CONNECT,
}


def _app(tmp_path: Path) -> FastAPI:
    return create_app(Settings(api_keys=["k"], state_dir=tmp_path / "state"))


def _operations(app: FastAPI, *, with_body: bool) -> list[tuple[str, str]]:
    """(method, a path the route matches) of each operation in the app's schema (E2B's
    routes at `/e2b` are the same routes again), only those that declare a body if asked."""
    found = []
    for path, operations in app.openapi()["paths"].items():
        sample = re.sub(r"\{[^}]+\}", "x", path)
        for method, operation in operations.items():
            if not with_body or "requestBody" in operation:
                found.append((method.upper(), sample))
    return found


def _guard(app: FastAPI) -> RequestGuard:
    layer = app.build_middleware_stack()
    while not isinstance(layer, RequestGuard):
        layer = layer.app  # type: ignore[attr-defined]
    return layer


def test_uploads_are_exactly_the_upload_routes(tmp_path: Path) -> None:
    app = _app(tmp_path)
    uploads = {(m, p) for m, p in _operations(app, with_body=False) if is_upload(m, p)}
    # Ours (multipart) and E2B's (multipart or raw; at `/` and at `/e2b`), and E2B's volume
    # files (raw).
    assert uploads == {
        ("POST", "/v1/sessions/x/files"),
        ("POST", "/v1/volumes/x/files"),
        ("POST", "/files"),
        ("PUT", "/volumecontent/x/file"),
    }
    assert is_upload("POST", "/e2b/files")
    assert is_upload("PUT", "/e2b/volumecontent/x/file")
    assert not is_upload("POST", "/volumecontent/x/file")
    for path in (
        "/no/such/files",
        "/v1/sessions/x/files/y",
        "/v1/volumes/x/files/y",
        "/console/files",
        "/e2b/x/files",
    ):
        assert not is_upload("POST", path), path


def test_every_body_an_app_route_takes_is_read_after_a_key_is_checked(tmp_path: Path) -> None:
    """The console's forms are a mounted app of their own (bodies read by the guard, at most
    64 KiB, before its login cookie is checked); every route here checks a key first."""
    app = _app(tmp_path)
    guard = _guard(app)
    operations = _operations(app, with_body=True)
    assert ("POST", "/v1/sessions/x/files") in operations  # the schema names bodies
    unchecked = [(m, p) for m, p in operations if guard.family(p) not in _CHECKED]
    assert unchecked == []
