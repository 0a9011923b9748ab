"""A real server with its E2B-compatible front on 127.0.0.1, and E2B's unmodified SDK pointed at
it through the environment variables a user sets (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)

E2B_VARIABLES = ("E2B_DEBUG", "E2B_DOMAIN", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")


def stop_cleanly(server: Server) -> None:
    assert server.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log.read_text()
    assert leftovers(server) == [], "the server left sandboxes behind on shutdown"
    shutil.rmtree(server.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def e2b_server() -> Iterator[Server]:
    """Two keys, every usable backend, a warm pool of one, E2B timeouts swept every second."""
    server = make_server(pool_size=1, max_upload_bytes=5 << 20, reap_interval_s=1)
    server.start()
    yield server
    stop_cleanly(server)


def point_sdk_at(monkeypatch: pytest.MonkeyPatch, url: str, key: str | None = KEY_A) -> None:
    for name in E2B_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    if key is not None:
        monkeypatch.setenv("E2B_API_KEY", key)


@pytest.fixture
def e2b_env(monkeypatch: pytest.MonkeyPatch, e2b_server: Server) -> Server:
    point_sdk_at(monkeypatch, e2b_server.url)
    return e2b_server


@pytest.fixture(params=service_backends())
def template(request: pytest.FixtureRequest) -> str:
    """E2B's template names our backends: each front test runs on each of them."""
    name: str = request.param
    return name


@pytest.fixture
def sbx(e2b_env: Server, template: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(template=template)
    yield sandbox
    sandbox.kill()
