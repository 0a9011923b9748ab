"""Attacks on the service: its secrets, its limits, its resources, its crashes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandbox import cgroups
from tests.conftest import host_processes_with
from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)

SECRET_KEY = "key-from-config-file-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    srv = make_server(max_request_bytes=1 << 20, max_upload_bytes=1 << 20)
    config = srv.state_dir.parent / "service.toml"
    config.write_text(f'api_keys = ["{SECRET_KEY}"]\n')
    srv.env["CODE_INTERPRETER_CONFIG"] = str(config)
    del srv.env["CODE_INTERPRETER_API_KEYS"]
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def client(srv: Server) -> httpx.Client:
    return srv.client(SECRET_KEY)


@pytest.mark.parametrize("backend", service_backends())
def test_the_services_secrets_are_out_of_reach(guarded: Server, backend: str) -> None:
    config = guarded.env["CODE_INTERPRETER_CONFIG"]
    with client(guarded) as api:
        sid = api.post("/v1/sessions", json={"backend": backend}).json()["id"]
        code = (
            "import glob, os\n"
            "blobs = []\n"
            "for p in glob.glob('/proc/[0-9]*/environ') + glob.glob('/proc/[0-9]*/cmdline'):\n"
            "    try:\n"
            "        blobs.append(open(p, 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            f"found = any(b'{SECRET_KEY}' in b or b'{KEY_A}' in b for b in blobs)\n"
            f"paths = [{config!r}, {str(guarded.state_dir)!r}]\n"
            "visible = [p for p in paths if os.path.exists(p)]\n"
            "(found, visible)"
        )
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()
        assert r["results"][0]["text"] == "(False, [])", r
        api.delete(f"/v1/sessions/{sid}")


def test_oversized_requests_are_refused_early(guarded: Server) -> None:
    with client(guarded) as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        big = api.post(f"/v1/sessions/{sid}/execute", json={"code": "#" * (2 << 20)})
        assert big.status_code == 413 and big.json()["error"]["type"] == "TooLarge"
        fits = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1  #" + "#" * 500_000})
        assert fits.status_code == 200 and fits.json()["status"] == "ok"
        tool = api.post(
            "/v1/tools/code_interpreter/invoke", json={"arguments": {"code": "#" * (2 << 20)}}
        )
        assert tool.status_code == 413

        def endless() -> Iterator[bytes]:  # chunked: no Content-Length to refuse it by
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\n'
            for _ in range(64):
                yield b"x" * (1 << 20)

        r = api.post(
            f"/v1/sessions/{sid}/files",
            params={"path": "huge.bin"},
            headers={"content-type": "multipart/form-data; boundary=b"},
            content=endless(),
        )
        assert r.status_code == 413
        assert api.get(f"/v1/sessions/{sid}/files").json() == []
        api.delete(f"/v1/sessions/{sid}")


# Worker pools grow one thread at a time, on demand, up to their caps: the event loop's default
# executor (min(32, cores + 4)), AnyIO's (40) and the workspace's file workers (8). An idle AnyIO
# worker is only pruned when the next call wants a thread, so pool threads grown at a busier
# moment may stay. Where the kernel sees Python's thread names (Python 3.14 gives them to the
# system) pool threads are counted apart, against those caps, and every other thread must not
# grow at all; where it does not (every thread is called after the program), a pool's thread
# cannot be told from any other, and the growth allowed is the pools' room to grow: a thread
# left behind by each of 200 sessions is still far past it.
_POOL_THREADS = {"asyncio_": min(32, (os.cpu_count() or 1) + 4), "AnyIO worker": 40}
_POOL_THREADS["workspace-files"[:15]] = 8  # a thread's name is cut at 15 characters
_UNNAMED_POOL_ROOM = sum(_POOL_THREADS.values())


def _census(srv: Server) -> dict[str, int]:
    assert srv.process is not None
    pid = srv.process.pid
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    counts = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    for prefix in _POOL_THREADS:
        counts[f"pool {prefix}"] = sum(1 for n in names if n.startswith(prefix))
    counts["threads"] = len(names) - sum(counts[f"pool {p}"] for p in _POOL_THREADS)
    counts["children"] = sum(
        1 for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid
    )
    return counts


def _thread_names(srv: Server) -> list[str]:
    assert srv.process is not None
    names = []
    for task in Path(f"/proc/{srv.process.pid}/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    return sorted(names)


def _settled_census(srv: Server, before: dict[str, int]) -> dict[str, int]:
    """The census once what ended sessions left running has had time to finish: on a busy
    machine a sandbox's last watcher thread may end a few seconds after its session. A leak
    stays; only a growth that lasts 20 s fails."""
    deadline = time.monotonic() + 20
    while True:
        after = _census(srv)
        settled = after["fds"] <= before["fds"] + 2 and after["threads"] <= before["threads"] + 2
        if settled or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _groups() -> set[str]:
    parent = cgroups.ROOT / "memory" / cgroups.PARENT
    return {p.name for p in parent.iterdir() if p.is_dir()} if parent.is_dir() else set()


class _SandboxIds:
    """The ids of the sandboxes a server makes, seen as their directories come and go (a
    sandbox's cgroup is named by its id): the server's own, apart from those of tests running
    beside this one."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            with contextlib.suppress(OSError):
                self.seen.update(p.name for p in self.where.iterdir())

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join()
        return self.seen


@pytest.mark.parametrize("backend", service_backends())
def test_two_hundred_sessions_in_parallel_leak_nothing(backend: str) -> None:
    srv = make_server(max_sessions_per_key=50, max_sessions_total=50)
    srv.start()
    try:
        ids = _SandboxIds(srv.state_dir / backend)
        with srv.client() as api:

            def cycle(i: int) -> str:
                with srv.client() as own:
                    created = own.post("/v1/sessions", json={"backend": backend})
                    assert created.status_code == 201, created.text
                    s = created.json()["id"]
                    r = own.post(f"/v1/sessions/{s}/execute", json={"code": f"{i} * 2"}).json()
                    assert own.delete(f"/v1/sessions/{s}").status_code == 204
                    return str(r["results"][0]["text"])

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                # A first round at the same concurrency grows what stays (worker threads,
                # connection pools); the 200 that follow must add nothing to it.
                list(pool.map(cycle, range(24)))
                time.sleep(1)
                before = _census(srv)
                results = list(pool.map(cycle, range(200)))
            assert results == [str(i * 2) for i in range(200)]
            after = _settled_census(srv, before)
            assert api.get("/v1/sessions").json() == []
        threads = _thread_names(srv)
        assert after["children"] == before["children"] == 0, (before, after)
        assert after["fds"] <= before["fds"] + 2, (before, after)
        named = any(after[f"pool {prefix}"] for prefix in _POOL_THREADS)
        room = 2 if named else _UNNAMED_POOL_ROOM
        assert after["threads"] <= before["threads"] + room, (before, after, threads)
        for prefix, cap in _POOL_THREADS.items():
            assert after[f"pool {prefix}"] <= cap, (before, after)
        assert leftovers(srv) == []
        seen = ids.stop()
        assert len(seen) >= 100, "the watch missed the server's sandboxes"
        time.sleep(1)  # a group is removed just after its sandbox's directory
        assert not _groups() & seen, "cgroups of ended sandboxes were left behind"
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_a_killed_service_leaves_no_process() -> None:
    srv = make_server()
    srv.start()
    # A duration of its own marks each backend's sleeper among the host's processes.
    markers = {b: f"1000.{uuid.uuid4().int % 10**9}" for b in service_backends()}
    with srv.client() as api:
        for backend, marker in markers.items():
            sid = api.post("/v1/sessions", json={"backend": backend}).json()["id"]
            api.post(
                f"/v1/sessions/{sid}/execute",
                json={"code": f"import subprocess; subprocess.Popen(['sleep', '{marker}'])"},
            )
    assert all(len(host_processes_with(marker)) == 1 for marker in markers.values())
    srv.stop(signal.SIGKILL)
    time.sleep(1.5)
    try:  # a local sandbox dies with the service (bwrap's --die-with-parent)...
        assert "local" not in markers or host_processes_with(markers["local"]) == []
    finally:  # ...a container is what a crash leaves: the restart removes it
        srv.start()
        srv.stop()
        assert all(host_processes_with(marker) == [] for marker in markers.values())
        assert leftovers(srv) == []
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
