"""Governance fixtures: a real `serve` on 127.0.0.1 with its own state dir (settings keys, an
admin key, the local and, where it runs, docker backends, host tools, the shell tool, a short
reap interval), and the `code-interpreter keys` CLI run against that state dir, as an operator
runs it beside the live service; API clients by key; a real redis-server on 127.0.0.1, and two
handles on one new store of each kind (SQLite, Redis)."""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from tests.orchestrator.governance.store_handles import StoreHandle, local_store, shared_store
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, leftovers, make_server

__all__ = ["ADMIN_KEY", "KEY_A", "KEY_B", "Server"]

ADMIN_KEY = "key-admin-" + uuid.uuid4().hex
HOST_TOOLS = {
    "python": ["tests.orchestrator.host_tools.tools_for_tests:TOOLS"],
    "session_default": ["add", "echo"],
    "call_timeout_s": 10,
}
REAP_INTERVAL_S = 0.5


@pytest.fixture(scope="session")
def governed_server() -> Iterator[Server]:
    """One server for the governance tests: keys are made per test, with names of their own."""
    server = make_server(
        admin_keys=ADMIN_KEY,
        host_tools=json.dumps(HOST_TOOLS),
        shell_tool="true",
        reap_interval_s=REAP_INTERVAL_S,
    )
    server.start()
    yield server
    assert server.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log.read_text()
    assert leftovers(server) == [], "the server left sandboxes behind on shutdown"
    shutil.rmtree(server.state_dir.parent, ignore_errors=True)


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_keys(server: Server, *args: str) -> CliResult:
    """`code-interpreter keys ARGS --state-dir <the server's>`, in this process (the CLI's own
    code, on the live service's state.db from another process than the service's). On a
    thread of its own: the CLI runs an event loop of its own, and the caller may be in one."""
    with ThreadPoolExecutor(1) as thread:
        result = thread.submit(
            CliRunner().invoke, cli_app, ["keys", *args, "--state-dir", str(server.state_dir)]
        ).result()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def keys(governed_server: Server) -> Callable[..., CliResult]:
    def run(*args: str) -> CliResult:
        return run_keys(governed_server, *args)

    return run


def add_key_to(server: Server, name: str, *flags: str) -> str:
    """`keys add NAME FLAGS...` on the server's state dir; the key, once the service takes it
    (within a second)."""
    made = run_keys(server, "add", name, *flags)
    assert made.exit_code == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("e2b_" if "--e2b-shaped" in flags else "cir_") and "\n" not in key
    with server.client(key) as client:
        assert eventually(lambda: client.get("/v1/whoami").status_code == 200)
    return key


@pytest.fixture
def add_key(governed_server: Server) -> Callable[..., str]:
    def add(name: str, *flags: str) -> str:
        return add_key_to(governed_server, name, *flags)

    return add


@pytest.fixture
def api(governed_server: Server) -> Iterator[Callable[[str], httpx.Client]]:
    """Clients of the API by key, closed after the test; sessions they made are deleted."""
    clients: list[httpx.Client] = []

    def client(key: str) -> httpx.Client:
        made = governed_server.client(key)
        clients.append(made)
        return made

    yield client
    for made in clients:
        for info in made.get("/v1/sessions").json():
            made.delete(f"/v1/sessions/{info['id']}")
        made.close()


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def eventually(check: Callable[[], bool], within_s: float = 15.0) -> bool:
    """Whether `check` comes true within `within_s` (looked at every 0.1 s)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


@pytest.fixture(params=["sqlite", "redis"])
async def store_pair(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[StoreHandle, StoreHandle]]:
    """Two handles on one new store, as two processes hold it (SQLite under a state dir: the
    service and the CLI) or two replicas (Redis, under a prefix of this test's own)."""
    a: StoreHandle
    b: StoreHandle
    if request.param == "sqlite":
        a, b = local_store(tmp_path / "state"), local_store(tmp_path / "state")
    else:
        url: str = request.getfixturevalue("redis_url")
        prefix = f"t{uuid.uuid4().hex[:10]}"
        a = shared_store(url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
        b = shared_store(url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    yield a, b
    for store in (a, b):
        await store.close()
