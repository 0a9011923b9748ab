"""E2B's unmodified SDK on the microvm backend, through a real server on 127.0.0.1 (its
E2B-compatible front, the `microvm` template): code, commands and files in a machine of its own,
then a pause and resume of the whole machine that keeps the kernel's variables and a background
command, which counts on."""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2b import SandboxState
from e2b_code_interpreter import Sandbox

from tests.conftest import host_processes_with, require_backend
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import Server, leftovers, make_server

pytestmark = pytest.mark.timeout(600)

COUNTER = (
    'i=0; while true; do i=$((i+1)); echo "$$ $i" > /tmp/count.new; '
    "mv /tmp/count.new /tmp/count; sleep 0.1; done"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server whose only backend is microvm (E2B's template `microvm` names it)."""
    require_backend("microvm")
    # No template machine made in the background: one session here, and CI's cores are few.
    running = make_server(
        backends="microvm", default_backend="microvm", microvm_templates="false"
    ).start()
    try:
        yield running
        running.stop()
        assert leftovers(running) == []  # no machine's directory left behind
        assert not qemu_of(running.state_dir), "a QEMU outlived its server"
    finally:
        if running.process is not None and running.process.poll() is None:
            running.stop()
        shutil.rmtree(running.state_dir.parent, ignore_errors=True)


def qemu_of(state_dir: Path) -> list[int]:
    """QEMU processes whose sockets are under `state_dir`."""
    return [pid for pid in host_processes_with(str(state_dir)) if b"qemu" in _argv0(pid)]


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, server: Server) -> Server:
    point_sdk_at(monkeypatch, server.url)
    return server


def wait_for(check: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def counted(sbx: Sandbox) -> tuple[int, int]:
    pid, count = sbx.commands.run("cat /tmp/count").stdout.split()
    return int(pid), int(count)


def has_counted(sbx: Sandbox) -> bool:
    return str(sbx.commands.run("if test -s /tmp/count; then echo yes; fi").stdout) == "yes\n"


def test_the_sdk_runs_a_machine_and_pauses_it_whole(sdk: Server) -> None:
    sbx = Sandbox.create(template="microvm", timeout=600)
    try:
        with sdk.client() as api:  # the session says what runs its machine
            info = api.get(f"/v1/sessions/{sbx.sandbox_id}").json()
        assert info["backend"] == "microvm" and info["runtime"] in ("kvm", "tcg"), info
        release = sbx.run_code("import platform; print(platform.release())").logs.stdout[0].strip()
        assert release and release != platform.release()
        assert sbx.run_code("x = 41\nx + 1").text == "42"
        sbx.files.write("data/in.txt", "from the sdk")
        assert sbx.run_code("print(open('data/in.txt').read())").logs.stdout == ["from the sdk\n"]
        assert sbx.commands.run("uname -r").stdout.strip() == release
        counter = sbx.commands.run(COUNTER, background=True)
        wait_for(lambda: has_counted(sbx), "the counter counted")
        pid, before = counted(sbx)
        assert pid == counter.pid

        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert resumed.run_code("x").text == "41"
        assert resumed.files.read("data/in.txt") == "from the sdk"
        wait_for(lambda: counted(resumed)[1] > before, "the counter counted on after the resume")
        assert counted(resumed)[0] == pid
    finally:
        sbx.kill()
