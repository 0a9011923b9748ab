"""Fixtures: real backends, real sandboxes, real kernels.

Every behaviour test runs once per backend. A backend whose engine is missing is skipped on a
developer's machine but fails in CI (CI=true), where everything must run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.registry import why_unavailable
from sandbox.tree_removal import remove_tree_at

# The E2B SDK's fixtures (a service the SDK is pointed at, a sandbox made through it) serve the
# front's tests (tests/orchestrator/e2b_compatible), the SDK suites (tests/clients/e2b_sdk) and
# the E2B backend's (tests/sandbox/backends): one module, so one server for all of them.
pytest_plugins = ["tests.e2b_sdk_fixtures"]

ALL_BACKENDS = ("local", "docker")
# Each test run labels its containers with an id of its own, so clean-up checks are exact.
TEST_ORCHESTRATOR_ID = f"test-{uuid.uuid4().hex[:8]}"
SELECTED = [b for b in os.environ.get("CIR_TEST_BACKENDS", ",".join(ALL_BACKENDS)).split(",") if b]


def backend_unavailable(name: str) -> str | None:
    """Why this backend cannot run here, or None when it can."""
    return why_unavailable(name)


# The OCI runtime of the Docker tests: `CIR_DOCKER_RUNTIME=runsc` runs them under gVisor
# (`make test-gvisor`); unset, the engine's default (runc).
DOCKER_RUNTIME = os.environ.get("CIR_DOCKER_RUNTIME") or None


def backend_config(name: str) -> dict[str, object]:
    if name != "docker":
        return {}
    config: dict[str, object] = {"orchestrator_id": TEST_ORCHESTRATOR_ID}
    if DOCKER_RUNTIME:
        config["runtime"] = DOCKER_RUNTIME
    return config


def require_backend(name: str) -> None:
    """Skip a test whose backend cannot run here; in CI, fail it instead."""
    why = backend_unavailable(name)
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the {name} backend must run in CI: {why}")
        pytest.skip(f"{name} backend unavailable: {why}")


@pytest.fixture(scope="session", params=SELECTED)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    name: str = request.param
    require_backend(name)
    instance = create_backend(name, **backend_config(name))
    await instance.cleanup_orphans()
    yield instance
    await instance.close()


def small_spec(**overrides: object) -> SandboxSpec:
    """Limits small enough that abuse tests finish quickly."""
    fields: dict[str, object] = {
        "limits": ResourceLimits(memory_mb=1024, tmp_size_mb=64, file_size_mb=64),
        "interrupt_grace_s": 2.0,
        "default_timeout_s": 60.0,
    }
    fields.update(overrides)
    return SandboxSpec.model_validate(fields)


@pytest.fixture(autouse=True)
def _tmp_path_removed_without_recursion(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests plant trees thousands of levels deep; pytest's own clean-up of old temporary
    directories recurses and would crash a later run on them, so each is removed here."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    path: Path = request.getfixturevalue("tmp_path")  # set up first, so torn down after this
    yield
    with contextlib.suppress(FileNotFoundError):
        remove_tree_at(path)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory of the test's own, reachable by sandbox uids (unlike tmp_path)."""
    path = Path(tempfile.mkdtemp(prefix="cir-test-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path / "state"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await backend.create(small_spec())
    try:
        yield sb
    finally:
        await sb.close()


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (sandboxed ones included)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP listener on the host's loopback that the sandbox must not reach."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    try:
        yield server.getsockname()[1]
        # Nothing ever connected.
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


# The slowest files first (see the slowest durations at the end of a run's log): under `make
# test` (--dist=loadfile, xdist's reordering by test count turned off) a file runs whole on one
# worker, and a long one that starts last is the run's tail while the other workers stand idle.
SLOWEST_FILES_FIRST = (
    "tests/security/test_service_abuse.py",
    "tests/orchestrator/cli/test_cli.py",
    "tests/clients/e2b_sdk/test_sdk_languages.py",
    "tests/gvisor/test_machine_sandbox.py",
    "tests/gvisor/test_machine_templates.py",
    "tests/gvisor/test_machine_sessions.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the slowest files' tests to the front, every other order kept (a stable sort)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
