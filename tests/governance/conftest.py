"""Governance fixtures: a real `serve` on 127.0.0.1 with its own state dir (settings keys, an
admin key, the local and, where it runs, docker backends, host tools, the shell tool, a short
reap interval), and the `code-interpreter keys` CLI run against that state dir, as an operator
runs it beside the live service."""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from tests.service.conftest import KEY_A, KEY_B, Server, leftovers, make_server

__all__ = ["ADMIN_KEY", "KEY_A", "KEY_B", "Server"]

ADMIN_KEY = "key-admin-" + uuid.uuid4().hex
HOST_TOOLS = {
    "python": ["tests.host_tools.tools_for_tests:TOOLS"],
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
    code, on the live service's state.db from another process than the service's)."""
    result = CliRunner().invoke(cli_app, ["keys", *args, "--state-dir", str(server.state_dir)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def keys(governed_server: Server) -> Callable[..., CliResult]:
    def run(*args: str) -> CliResult:
        return run_keys(governed_server, *args)

    return run


@pytest.fixture
def add_key(keys: Callable[..., CliResult], governed_server: Server) -> Callable[..., str]:
    """`keys add NAME FLAGS...`; the key, once the service takes it (within a second)."""

    def add(name: str, *flags: str) -> str:
        made = keys("add", name, *flags)
        assert made.exit_code == 0, made.stderr
        key = made.stdout.strip()
        assert key.startswith("cir_") and "\n" not in key
        with governed_server.client(key) as client:
            assert eventually(lambda: client.get("/v1/whoami").status_code == 200)
        return key

    return add


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
