"""A real server, started as a user starts it (`code-interpreter serve`), on 127.0.0.1."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import DOCKER_RUNTIME, SELECTED, backend_unavailable

KEY_A, KEY_B = "key-a-" + uuid.uuid4().hex, "key-b-" + uuid.uuid4().hex


def service_backends() -> list[str]:
    """The backends the service tests use: those selected, when they can run (CI: all)."""
    usable = [b for b in SELECTED if backend_unavailable(b) is None or os.environ.get("CI")]
    return usable or ["local"]


@dataclass
class Server:
    url: str
    env: dict[str, str]
    state_dir: Path
    orchestrator_id: str
    process: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="cir-serve-")))
    open_files: int | None = None  # the server's open-file limit (soft and hard), if lowered

    def start(self) -> Server:
        port = self.url.rsplit(":", 1)[1]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "serve", "--port", port],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=None if self.open_files is None else self._limit_open_files,
            )
        # Generous: a loaded machine's first gVisor server unpacks its image's root first.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not come up: {self.log.read_text()[-3000:]}")

    def _limit_open_files(self) -> None:
        assert self.open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)

    def client(self, key: str | None = KEY_A, **kwargs: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_server(**settings: object) -> Server:
    root = Path(tempfile.mkdtemp(prefix="cir-svc-", dir="/tmp"))
    root.chmod(0o711)
    orchestrator_id = f"svc-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "CODE_INTERPRETER_API_KEYS": f"{KEY_A},{KEY_B}",
        "CODE_INTERPRETER_BACKENDS": ",".join(service_backends()),
        "CODE_INTERPRETER_DEFAULT_BACKEND": service_backends()[0],
        "CODE_INTERPRETER_STATE_DIR": str(root / "state"),
        "CODE_INTERPRETER_ORCHESTRATOR_ID": orchestrator_id,
        # Many tests share a server and one address, and some wait for a key the CLI just
        # added by trying it (401 until the service takes it): the throttle of wrong keys is
        # tested with its defaults by tests/security/test_key_guessing.py.
        "CODE_INTERPRETER_AUTH_FAILURES_PER_MINUTE": "100000",
        "CODE_INTERPRETER_AUTH_FAILURES_PER_MINUTE_PER_KEY_PREFIX": "100000",
    }
    if DOCKER_RUNTIME:  # `make test-gvisor`: the server's Docker sessions under it too
        env["CODE_INTERPRETER_DOCKER_RUNTIME"] = DOCKER_RUNTIME
    for name, value in settings.items():
        env[f"CODE_INTERPRETER_{name.upper()}"] = str(value)
    return Server(f"http://127.0.0.1:{free_port()}", env, root / "state", orchestrator_id)


def leftovers(server: Server) -> list[str]:
    """Sandboxes, containers or directories the server left behind."""
    found = []
    for backend in ("local", "docker", "wasm", "microvm"):
        d = server.state_dir / backend
        if d.is_dir():
            found += [f"{backend}: {p.name}" for p in d.iterdir()]
    with open("/proc/self/mounts") as mounts:  # workspaces' tmpfs, volumes' images
        found += [
            f"mount: {point}"
            for point in (line.split()[1] for line in mounts)
            if point.startswith(f"{server.state_dir}/")
        ]
    if "docker" in service_backends():
        import docker

        client = docker.from_env()
        label = f"code-interpreter.orchestrator={server.orchestrator_id}"
        found += [
            c.name
            for c in client.containers.list(all=True, ignore_removed=True, filters={"label": label})
        ]
    return found


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The shared server: two keys, every usable backend, a warm pool of one."""
    srv = make_server(pool_size=1, max_upload_bytes=5 << 20, tool_output_max_chars=2000)
    srv.start()
    yield srv
    # uvicorn shuts down gracefully on SIGTERM, then exits by the same signal.
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in srv.log.read_text()
    assert leftovers(srv) == [], "the server left sandboxes behind on shutdown"
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(params=service_backends())
def session_id(request: pytest.FixtureRequest, api: httpx.Client) -> Iterator[str]:
    """A fresh session on each backend, deleted after the test."""
    created = api.post("/v1/sessions", json={"backend": request.param})
    assert created.status_code == 201, created.text
    sid: str = created.json()["id"]
    yield sid
    api.delete(f"/v1/sessions/{sid}")


@pytest.fixture
def server_url(server: Server) -> str:
    return server.url
