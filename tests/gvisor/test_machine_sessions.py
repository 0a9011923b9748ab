"""Sessions on gVisor machines through the service (a real server on 127.0.0.1): a pause saves
the whole machine, a resume restores it, a restart of the service keeps it, a delete removes it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from code_interpreter_client import Client
from tests.conftest import require_backend
from tests.orchestrator.service.conftest import KEY_A, Server, make_server

GENERATOR = (
    "def counting():\n    n = 0\n    while True:\n        n += 1\n        yield n\n"
    "c = counting()\nnext(c)"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_backend("gvisor")
    running = make_server(backends="gvisor", default_backend="gvisor").start()
    yield running
    if running.process is not None and running.process.poll() is None:
        running.stop()
    shutil.rmtree(running.state_dir.parent, ignore_errors=True)


def test_a_paused_machine_session_resumes_whole_even_after_a_restart(server: Server) -> None:
    with Client(server.url, KEY_A) as api:
        sid = api.create_session().id
        try:
            assert api.execute(sid, GENERATOR).text == "1"
            paused = api.pause(sid)
            assert paused.state == "paused", paused
            machines = list((server.state_dir / "gvisor-paused").iterdir())
            assert len(machines) == 1  # saved whole, not as the kernel's variables
            server.stop()
            server.start()
            resumed = api.resume(sid)
            assert resumed.session.state == "running", resumed
            # A generator does not pickle: only the machine image keeps it.
            assert api.execute(sid, "next(c)").text == "2"
            api.pause(sid)
        finally:
            api.delete_session(sid)
        assert not any((server.state_dir / "gvisor-paused").iterdir())  # deleted with it
