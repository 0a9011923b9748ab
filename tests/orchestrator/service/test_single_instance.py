"""One live service per state dir (issue 13, item 11).

A second `serve` with the same orchestrator id and state dir used to clean up "orphans" at start:
it removed the first service's live containers (and wiped its kept outputs), then failed to
bind. Now it stops before touching anything, naming the lock and the instance that holds it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.instance_lock import InstanceAlreadyRunning, InstanceLock
from tests.orchestrator.service.conftest import (
    Server,
    free_port,
    leftovers,
    make_server,
    service_backends,
)


@pytest.fixture
def first() -> Iterator[Server]:
    srv = make_server()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        assert leftovers(srv) == []
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_a_second_instance_on_the_same_state_dir_refuses_to_start(first: Server) -> None:
    assert first.process is not None
    with first.client() as api:
        sessions = {}  # backend -> (session id, id of its kept execution)
        for backend in service_backends():
            created = api.post("/v1/sessions", json={"backend": backend})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41; print('kept')"})
            assert ran.status_code == 200, ran.text
            sessions[backend] = (sid, ran.json()["execution_id"])

        # The same orchestrator id and state dir, on a port of its own (so that binding cannot
        # be what stops it).
        second = Server(
            f"http://127.0.0.1:{free_port()}", first.env, first.state_dir, first.orchestrator_id
        )
        try:
            second.start()
            came_up = True
        except RuntimeError:  # it exited before answering
            came_up = False
        finally:
            if second.process is not None and second.process.poll() is None:
                second.stop()

        # The first service did not notice: its kernels still hold their state, its kept
        # outputs are still there.
        state, kept = {}, {}
        for backend, (sid, execution_id) in sessions.items():
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x + 1"}).json()
            state[backend] = ran["results"][0]["text"] if ran.get("results") else ran
            got = api.get(f"/v1/sessions/{sid}/executions/{execution_id}").json()
            kept[backend] = got.get("stdout", got)
            api.delete(f"/v1/sessions/{sid}")
        assert state == dict.fromkeys(sessions, "42")
        assert kept == dict.fromkeys(sessions, "kept\n")

        said = second.log.read_text()
        assert not came_up, f"a second instance started on the same state dir: {said[-3000:]}"
        assert second.process is not None and second.process.returncode != 0, said
        assert str(first.state_dir / "service.lock") in said, said
        assert f"pid {first.process.pid}" in said, said


def test_the_lock_is_released_when_the_service_stops() -> None:
    srv = make_server()
    try:
        srv.start()
        srv.stop()
        srv.url = f"http://127.0.0.1:{free_port()}"
        srv.start()  # the same state dir: free again
        srv.stop()
    finally:
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_the_lock_names_its_holder(state_dir: Path) -> None:
    held = InstanceLock.acquire(state_dir, "first")
    try:
        with pytest.raises(InstanceAlreadyRunning) as refused:
            InstanceLock.acquire(state_dir, "second")
        message = str(refused.value)
        assert str(held.path) in message and f"pid {os.getpid()}" in message
        assert "'first'" in message and "'second'" in message
    finally:
        held.release()
    InstanceLock.acquire(state_dir, "second").release()  # free again
