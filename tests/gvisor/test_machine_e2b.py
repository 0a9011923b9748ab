"""E2B's unmodified SDK pauses and resumes a sandbox on the gvisor backend: the whole machine is
saved (a real server on 127.0.0.1, its E2B-compatible front, the `gvisor` template), so the
kernel's variables and a background command come back as they were, and the command counts on."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator

import pytest
from e2b import SandboxQuery, SandboxState
from e2b_code_interpreter import Sandbox

from tests.conftest import require_backend
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import Server, make_server

pytestmark = pytest.mark.timeout(300)

# Writes "<its pid> <count>" ten times a second, to a file of the machine's own /tmp (the
# rename: a reader never sees it half written).
COUNTER = (
    'i=0; while true; do i=$((i+1)); echo "$$ $i" > /tmp/count.new; '
    "mv /tmp/count.new /tmp/count; sleep 0.1; done"
)
GENERATOR = (
    "def counting():\n    n = 0\n    while True:\n        n += 1\n        yield n\n"
    "c = counting()\nx = 41\nnext(c)"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server whose only backend is gvisor (E2B's template `gvisor` names it)."""
    require_backend("gvisor")
    running = make_server(backends="gvisor", default_backend="gvisor").start()
    yield running
    if running.process is not None and running.process.poll() is None:
        running.stop()
    shutil.rmtree(running.state_dir.parent, ignore_errors=True)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, server: Server) -> Server:
    point_sdk_at(monkeypatch, server.url)
    return server


def wait_for(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    """Look again and again until `check` holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def counted(sbx: Sandbox) -> tuple[int, int]:
    """(the counter's pid, its count), read inside the machine."""
    pid, count = sbx.commands.run("cat /tmp/count").stdout.split()
    return int(pid), int(count)


def test_the_sdk_pauses_and_resumes_a_whole_gvisor_machine(sdk: Server) -> None:
    sbx = Sandbox.create(template="gvisor")
    sid = sbx.sandbox_id
    try:
        assert sbx.run_code(GENERATOR).text == "1"
        counter = sbx.commands.run(COUNTER, background=True)
        wait_for(
            lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, "the counter counted"
        )
        pid, before = counted(sbx)
        assert pid == counter.pid and pid in {p.pid for p in sbx.commands.list()}

        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert [x.sandbox_id for x in paused] == [sid]
        with sdk.client() as api:
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
        # Saved whole as a machine image, not as the kernel's variables.
        machines = list((sdk.state_dir / "gvisor-paused").iterdir())
        assert len(machines) == 1 and (machines[0] / "image").is_dir(), machines

        back = Sandbox.connect(sid)
        assert back.get_info().state == SandboxState.RUNNING
        assert back.run_code("x + 1").text == "42"
        assert back.run_code("next(c)").text == "2"  # a generator: only the machine keeps it
        assert pid in {p.pid for p in back.commands.list()}
        again, resumed_at = counted(back)
        assert again == pid and resumed_at >= before  # the same shell, its count kept
        wait_for(lambda: counted(back)[1] >= resumed_at + 5, "the counter counting on")
        assert counted(back)[0] == pid
        assert not any((sdk.state_dir / "gvisor-paused").iterdir())  # the image is spent
    finally:
        Sandbox.kill(sid)
