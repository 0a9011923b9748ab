"""Sessions on gVisor machines through the service (a real server on 127.0.0.1): a pause saves
the whole machine, a resume restores it, a restart of the service keeps it, a delete removes it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from code_interpreter_client import APIError, Client
from tests.gvisor.conftest import machine_server
from tests.orchestrator.service.conftest import KEY_A, Server

GENERATOR = (
    "def counting():\n    n = 0\n    while True:\n        n += 1\n        yield n\n"
    "c = counting()\nnext(c)"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with machine_server("gvisor,local") as running:
        yield running


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


TICKER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/ticks; sleep 0.1; done"
KEY_AND_DRAW = (
    "import json, random\n"
    "from ipykernel.kernelapp import IPKernelApp\n"
    "with open(IPKernelApp.instance().connection_file) as f:\n"
    "    on_file = json.load(f)['key']\n"
    "key = get_ipython().kernel.session.key.decode()\n"
    "print(json.dumps({'key': key, 'on_file': on_file, 'draw': random.random(),"
    " 'next': next(c), 'x': x}))"
)


# The ticker's file is missing before its first tick and empty for a moment at each one (the
# shell truncates it before writing): both read as no tick yet.
READ_TICKS = (
    "import pathlib\n"
    "_t = pathlib.Path('/tmp/ticks')\n"
    "int(_t.read_text() or 0) if _t.exists() else 0"
)


def _ticks(api: httpx.Client, sid: str) -> int:
    done = api.post(f"/v1/sessions/{sid}/execute", json={"code": READ_TICKS})
    assert done.status_code == 200 and done.json()["status"] == "ok", done.text
    return int(done.json()["results"][0]["text"])


def _until_ticks_pass(api: httpx.Client, sid: str, count: int) -> None:
    """The session's ticker counts past `count` (it runs on), within 30 s."""
    deadline = time.monotonic() + 30
    while _ticks(api, sid) <= count:
        assert time.monotonic() < deadline, f"the ticker of {sid} stopped at {count}"
        time.sleep(0.1)


def test_forks_of_a_machine_snapshot_carry_memory_and_processes_with_keys_of_their_own(
    server: Server,
) -> None:
    with server.client() as api:
        created = api.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        forks: list[str] = []
        try:
            assert (
                api.post(f"/v1/sessions/{sid}/execute", json={"code": GENERATOR}).status_code == 200
            )
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41\nimport random"})
            ticker = api.post(f"/v1/sessions/{sid}/processes", json={"command": TICKER})
            assert ticker.status_code == 201, ticker.text
            _until_ticks_pass(api, sid, 2)
            taken = api.post(f"/v1/sessions/{sid}/snapshots", json={"name": "machine"})
            assert taken.status_code == 201, taken.text
            snap = taken.json()
            assert snap["whole_sandbox"] is True and snap["bytes"] > 1 << 20, snap
            # The session itself runs on after its snapshot, its ticker too.
            _until_ticks_pass(api, sid, _ticks(api, sid))
            for _ in range(2):
                made = api.post("/v1/sessions", json={"snapshot_id": snap["id"]})
                assert made.status_code == 201, made.text
                forks.append(made.json()["id"])
            seen = []
            for fork in forks:
                out = api.post(f"/v1/sessions/{fork}/execute", json={"code": KEY_AND_DRAW})
                assert out.status_code == 200 and out.json()["status"] == "ok", out.text
                seen.append(json.loads(out.json()["stdout"]))
                listed = api.get(f"/v1/sessions/{fork}/processes").json()
                assert [p["running"] for p in listed] == [True], listed
                _until_ticks_pass(api, fork, _ticks(api, fork))  # its own copy of the ticker
            origin = api.post(f"/v1/sessions/{sid}/execute", json={"code": KEY_AND_DRAW})
            seen.append(json.loads(origin.json()["stdout"]))
            # Memory carried: the generator goes on from where it was, in each fork alike.
            assert [s["next"] for s in seen] == [2, 2, 2] and {s["x"] for s in seen} == {41}
            # Secrets and random streams of their own; the key on file is the kernel's own.
            assert len({s["key"] for s in seen}) == 3 and len({s["draw"] for s in seen}) == 3
            assert all(s["key"] == s["on_file"] for s in seen)
            refused = api.post("/v1/sessions", json={"snapshot_id": snap["id"], "backend": "local"})
            assert refused.status_code == 409 and "gvisor backend" in refused.text, refused.text
        finally:
            for one in [sid, *forks]:
                api.delete(f"/v1/sessions/{one}")


def test_a_machine_session_keeps_its_volume_across_a_whole_pause(server: Server) -> None:
    """A volume in a gVisor machine through the service: written inside, held while the machine
    is saved whole (not deleted under it; written from outside meanwhile), mounted again where
    it was when the machine is restored."""
    with Client(server.url, KEY_A) as api:
        volume = api.create_volume("machine-data", size_mb=16).id
        sid = api.create_session(volumes=[{"volume_id": volume, "path": "/mnt/v"}]).id
        try:
            wrote = api.execute(sid, GENERATOR + "\nopen('/mnt/v/inside', 'w').write('1')")
            assert wrote.error is None, wrote
            assert api.pause(sid).state == "paused"
            assert len(list((server.state_dir / "gvisor-paused").iterdir())) == 1
            with pytest.raises(APIError) as held:
                api.delete_volume(volume)
            assert held.value.status == 409, held.value
            api.upload_to_volume(volume, "outside", b"2")
            assert api.resume(sid).session.state == "running"
            both = api.execute(
                sid, "print(next(c), open('/mnt/v/inside').read(), open('/mnt/v/outside').read())"
            )
            assert both.stdout == "2 1 2\n", both
            # A whole snapshot of it starts only with the volume where it was (refused first).
            snap = api.snapshot(sid, name="with-volume").id
            for volumes in ([], [{"volume_id": volume, "path": "/mnt/v", "read_only": True}]):
                with pytest.raises(APIError) as unfit:
                    api.create_session(snapshot_id=snap, volumes=volumes)
                assert unfit.value.status == 409 and "/mnt/v" in unfit.value.message, unfit.value
            fork = api.create_session(
                snapshot_id=snap, volumes=[{"volume_id": volume, "path": "/mnt/v"}]
            ).id
            try:
                assert api.execute(fork, "print(next(c), open('/mnt/v/inside').read())").stdout == (
                    "3 1\n"
                )
            finally:
                api.delete_session(fork)
            api.delete_snapshot(snap)
        finally:
            api.delete_session(sid)
        assert api.download_from_volume(volume, "inside") == b"1"
        api.delete_volume(volume)  # let go with its session
