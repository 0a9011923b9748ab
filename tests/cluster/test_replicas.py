"""Two real service replicas (`code-interpreter serve --backend ray --ray-address ... --store
redis://...`) over one real 3-node Ray cluster and one real redis-server, all on 127.0.0.1: any
replica serves any session, ends happen once, caps hold across replicas, a node lost takes
exactly its sessions (410 SessionLost), a replica lost loses nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from code_interpreter_wire.background_loop import run_sync
from orchestrator.cluster.coordination_store import CoordinationStore
from orchestrator.config import Settings
from orchestrator.state_store.records import SessionRecord
from orchestrator.state_store.redis_connection import RedisConnection
from orchestrator.state_store.redis_store import RedisStore
from tests.cluster.conftest import RayTestCluster
from tests.cluster.redis_server import free_port, redis_server
from tests.network.conftest import FETCH
from tests.network.upstream import HELLO, Upstream

KEY_A, KEY_B, KEY_CAPS = (f"key-{n}-{uuid.uuid4().hex}" for n in ("a", "b", "caps"))
PER_KEY = 3  # max_sessions_per_key of the replicas
ORCHESTRATOR_ID = f"rep-{uuid.uuid4().hex[:8]}"
TOOLS = {"python": ["tests.orchestrator.host_tools.tools_for_tests:TOOLS"], "call_timeout_s": 20}


@dataclass
class Replica:
    """One `code-interpreter serve` process of the cluster's service."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    ray_root: Path | None = None  # where the cluster's nodes keep their logs (the drivers' too)
    process: subprocess.Popen[bytes] | None = None
    clients: list[httpx.Client] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        for _ in _polls(120):
            if self.process.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
        raise RuntimeError(f"replica {self.name} did not come up: {self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the replica and wait for it; told to stop (SIGTERM), it must exit cleanly, or
        the test fails with what it and its Ray driver logged (gone with the cluster later)."""
        assert self.process is not None
        pid = self.process.pid
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # killed, and the test fails saying where it hung
            self.process.kill()
            self.process.wait()
            self.process = None
            pytest.fail(f"did not stop within 60 s of {sig!r}: " + self._exit_report(pid, -9))
        self.process = None
        if sig == signal.SIGTERM:
            assert code in (0, -signal.SIGTERM), self._exit_report(pid, code)
        return code

    def _exit_report(self, pid: int, code: int) -> str:
        report = [f"replica {self.name} (pid {pid}) exited {code}; its log ends:"]
        report.append(self.log.read_text(errors="replace")[-4000:])
        drivers = self.ray_root.glob(f"**/*core-driver*_{pid}.log") if self.ray_root else ()
        for driver_log in drivers:
            report += [f"{driver_log} ends:", driver_log.read_text(errors="replace")[-6000:]]
        return "\n".join(report)

    def client(self, key: str = KEY_A) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def metric(self, name: str) -> dict[str, float]:
        """Each series of a metric on /metrics: its labels' text -> value."""
        text = httpx.get(
            f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30
        ).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            m = re.fullmatch(rf"{name}(\{{[^}}]*\}})?\s+(\S+)", line)
            if m:
                found[m.group(1) or ""] = float(m.group(2))
        return found


def _polls(seconds: float) -> Iterator[None]:
    """Wait for a condition, checking often; not a timed assertion: the caller says what failed."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield
        time.sleep(0.2)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


class SharedView:
    """The test's own view of the shared store (what the replicas keep), for these synchronous
    tests: each call is awaited on the process's background loop."""

    def __init__(self, url: str, snapshots_dir: Path) -> None:
        self.connection = RedisConnection(url)
        self.records = RedisStore(self.connection, snapshots_dir=snapshots_dir)
        self.coordination = CoordinationStore(self.connection)

    def sessions(self) -> list[SessionRecord]:
        return run_sync(self.records.sessions())

    def get_session(self, session_id: str) -> SessionRecord | None:
        return run_sync(self.records.get_session(session_id))

    def put_session(self, record: SessionRecord) -> None:
        run_sync(self.records.put_session(record))

    def slots_held(self) -> int:
        return run_sync(self.coordination.slots_held())

    def admit(self, owner: str, session_id: str, per_key: int, total: int) -> str | None:
        return run_sync(self.coordination.admit(owner, session_id, per_key, total))

    def ended(self, session_id: str) -> tuple[str, str] | None:
        return run_sync(self.coordination.ended(session_id))

    def close(self) -> None:
        run_sync(self.connection.close())


@pytest.fixture(scope="module")
def store(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedView]:
    """The test's own view of the shared store (what the replicas keep)."""
    shared = SharedView(redis_url, tmp_path_factory.mktemp("snaps"))
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def replicas(
    ray_cluster: RayTestCluster, redis_url: str, store: SharedView, egress_upstream: Upstream
) -> Iterator[tuple[Replica, Replica]]:
    root = Path(tempfile.mkdtemp(prefix="cir-rep-", dir="/tmp"))
    root.chmod(0o711)
    made: list[Replica] = []
    for name in ("a", "b"):
        env = {
            **os.environ,
            **ray_cluster.env,
            "CODE_INTERPRETER_API_KEYS": f"{KEY_A},{KEY_B},{KEY_CAPS}",
            "CODE_INTERPRETER_STATE_DIR": str(root / name),
            "CODE_INTERPRETER_ORCHESTRATOR_ID": ORCHESTRATOR_ID,
            "CODE_INTERPRETER_RAY_NODE_IP": "127.0.0.1",
            "CODE_INTERPRETER_REAP_INTERVAL_S": "0.5",
            "CODE_INTERPRETER_MAX_SESSIONS_PER_KEY": str(PER_KEY),
            "CODE_INTERPRETER_HOST_TOOLS": json.dumps(TOOLS),
            "CODE_INTERPRETER_METRICS_PUBLIC": "true",
            # Every replica's saved states in one directory (a shared volume in production).
            "CODE_INTERPRETER_SAVED_STATES_DIR": str(root / "saved-states"),
            "CODE_INTERPRETER_VOLUMES_DIR": str(root / "volumes"),  # shared, as saved states
            # Sessions may reach the loopback web server standing in for the internet, by name.
            "CODE_INTERPRETER_NETWORK_CEILING": "any",
            "CODE_INTERPRETER_EGRESS_RESOLVE": "allowed.test=127.0.0.1,other.test=127.0.0.1",
            "CODE_INTERPRETER_EGRESS_PRIVATE_HOSTS": ",".join(
                f"{name}:{egress_upstream.port}" for name in ("allowed.test", "other.test")
            ),
        }
        port = free_port()
        argv = [
            sys.executable, "-m", "orchestrator", "serve", "--port", str(port),
            "--backend", "ray", "--ray-address", ray_cluster.address, "--store", redis_url,
        ]  # fmt: skip
        log = root / f"{name}.log"
        made.append(Replica(name, argv, env, port, log, ray_cluster.cluster.root).start())
    a, b = made
    try:
        yield a, b
    finally:
        failures: list[str] = []
        for replica in made:  # every one stopped, whatever the others did
            if replica.process is not None:
                try:
                    replica.stop()
                except AssertionError as exc:
                    failures.append(str(exc))
        shutil.rmtree(root, ignore_errors=True)
        assert not failures, "\n\n".join(failures)
    # Every session was ended by a test (a replica's shutdown leaves them to the cluster):
    # nothing is left in the store, and every place under the caps was given back.
    assert store.sessions() == []
    assert store.slots_held() == 0


def _create(replica: Replica, key: str = KEY_A, **body: object) -> str:
    with replica.client(key) as api:
        created = api.post("/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["backend"] == "ray"
    sid: str = created.json()["id"]
    return sid


def _execute(replica: Replica, sid: str, code: str, key: str = KEY_A) -> dict[str, Any]:
    with replica.client(key) as api:
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    main = [x for x in out["results"] if x["is_main_result"]]
    out["text"] = main[0]["text"] if main else None
    return out


def _delete(replica: Replica, sid: str, key: str = KEY_A) -> None:
    with replica.client(key) as api:
        assert api.delete(f"/v1/sessions/{sid}").status_code in (204, 410)


def _node_of(ray_cluster: RayTestCluster, store: SharedView, sid: str) -> str:
    record = store.get_session(sid)
    assert record is not None and record.sandbox_handle is not None
    return ray_cluster.node_of_actor(record.sandbox_handle)


# ---------------------------------------------------------------------------------------------


def test_replica_refuses_ray_without_a_shared_store(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "CODE_INTERPRETER_API_KEYS": "k",
        "CODE_INTERPRETER_STATE_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--ray-address", "127.0.0.1:1"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert b"the ray backend needs a shared store" in done.stderr
    with pytest.raises(ValueError, match="store_url must be redis://"):
        Settings(api_keys=["k"], store_url="http://127.0.0.1:1")
    given = Settings(
        api_keys=["k"], backends=["ray"], default_backend="ray", store_url="redis://:pw@h:1/0"
    )
    assert given.cluster_mode and given.ray_backend_config()["namespace"] == "code-interpreter"
    assert given.ray_backend_config()["allow_unauthenticated"] is False
    open_ = given.model_copy(update={"ray_allow_unauthenticated": True})
    assert open_.ray_backend_config()["allow_unauthenticated"] is True
    # An address for a backend not enabled is refused, not ignored (`serve` exits 2 saying so).
    with pytest.raises(ValueError, match=r"ray_address .* the ray backend is not enabled"):
        Settings(api_keys=["k"], backends=["local"], ray_address="127.0.0.1:1")


@pytest.mark.cluster
def test_replica_b_serves_a_session_made_through_a(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    sid = _create(a)
    try:
        assert _execute(a, sid, "x = 20\nx + 1")["text"] == "21"
        # Executed, streamed, uploaded to, listed and interrupted through B.
        assert _execute(b, sid, "x * 2")["text"] == "40"
        with b.client() as api:
            with api.stream(
                "POST",
                f"/v1/sessions/{sid}/execute/stream",
                json={"code": "for i in range(3): print(i, flush=True)\n'end'"},
            ) as response:
                events = [json.loads(line) for line in response.iter_lines()]
            assert [e["type"] for e in events if e["type"] != "keepalive"] == [
                "stdout", "stdout", "stdout", "result", "done",
            ]  # fmt: skip
            up = api.post(f"/v1/sessions/{sid}/files", files={"file": ("data.txt", b"hello")})
            assert up.status_code == 201, up.text
            listed = api.get("/v1/sessions")
            assert sid in [s["id"] for s in listed.json()]
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "running"
        with a.client() as api:
            got = api.get(f"/v1/sessions/{sid}/files/data.txt")
            assert got.status_code == 200 and got.content == b"hello"
        # A long run streamed through A, interrupted through B once it has started.
        started = threading.Event()
        events: list[dict[str, Any]] = []

        def run() -> None:
            with (
                a.client() as api,
                api.stream(
                    "POST",
                    f"/v1/sessions/{sid}/execute/stream",
                    json={"code": "import time\nprint('started', flush=True)\ntime.sleep(600)"},
                ) as response,
            ):
                for line in response.iter_lines():
                    events.append(json.loads(line))
                    if events[-1]["type"] == "stdout":
                        started.set()

        runner = threading.Thread(target=run)
        runner.start()
        assert started.wait(120), events
        with b.client() as api:
            interrupted = api.post(f"/v1/sessions/{sid}/interrupt")
        runner.join(120)
        assert interrupted.json() == {"interrupted": True}
        assert not runner.is_alive() and events[-1]["type"] == "done", events
        outcome = events[-1]["execution"]
        assert outcome["status"] == "cancelled", outcome
        still = _execute(b, sid, "x")
        assert still["text"] == "20", (
            outcome,
            still["error"],
            still["notice"],
        )  # the same kernel, still there
        # Another key's session is a 404, exactly like a missing one, on either replica.
        with b.client(KEY_B) as other:
            assert other.get(f"/v1/sessions/{sid}").status_code == 404
            assert other.get("/v1/sessions/s-000000000000000000000000").status_code == 404
    finally:
        _delete(b, sid)
    for replica in (a, b):
        with replica.client() as api:
            gone = api.get(f"/v1/sessions/{sid}")
        assert gone.status_code == 410 and "was deleted" in gone.json()["error"]["message"]


SVG = (
    "from IPython.display import SVG, display\n"
    'print("shown")\n'
    'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg"><rect width="5" height="5"/></svg>\'))'
)


@pytest.mark.cluster
def test_replica_kept_outputs_are_fetched_through_the_other_replica(
    replicas: tuple[Replica, Replica], redis_url: str
) -> None:
    """An execution's kept JSON and its image, run through A, fetched through B (no sticky
    routing); they go with the session, whichever replica ends it."""
    a, b = replicas
    raw = redis.Redis.from_url(redis_url)
    sid = _create(a)
    try:
        ran = _execute(a, sid, SVG)
        [shown] = ran["results"]
        artifact_id = hashlib.sha256(shown["svg"].encode()).hexdigest()[:24]  # content-derived
        with b.client() as api:
            kept = api.get(f"/v1/sessions/{sid}/executions/{ran['execution_id']}")
            assert kept.status_code == 200 and kept.json()["stdout"] == "shown\n", kept.text
            image = api.get(f"/v1/sessions/{sid}/artifacts/{artifact_id}")
            assert image.status_code == 200 and b"<rect" in image.content, image.text
            assert image.headers["content-type"].startswith("image/svg+xml")
            assert image.headers["content-security-policy"].endswith("sandbox")
        kept_keys = {key.decode() for key in raw.scan_iter(f"cir:out:s:{sid}:*")}
        assert {f"cir:out:s:{sid}:x:{ran['execution_id']}"} < kept_keys
    finally:
        _delete(b, sid)
    # Gone from the store (only the mark that refuses a late save stays, for a while), so
    # from every replica.
    assert [key.decode() for key in raw.scan_iter(f"cir:out:s:{sid}:*")] == [
        f"cir:out:s:{sid}:dropped"
    ]
    with a.client() as api:
        gone = api.get(f"/v1/sessions/{sid}/artifacts/{artifact_id}")
    assert gone.status_code in (404, 410), gone.text


@pytest.mark.cluster
def test_replica_sessions_spread_and_a_lost_node_takes_exactly_its_own(
    replicas: tuple[Replica, Replica], ray_cluster: RayTestCluster, store: SharedView
) -> None:
    a, b = replicas
    extra = ray_cluster.start_node(3)  # the emptiest: the next sessions land there first
    keys: dict[str, str] = {}  # session id -> its owner's key (two keys: the cap is per key)
    try:
        for i in range(4):
            key = (KEY_A, KEY_B)[i % 2]
            keys[_create((a, b)[i // 2], key)] = key
        nodes = {sid: _node_of(ray_cluster, store, sid) for sid in keys}
        assert len(set(nodes.values())) >= 2, nodes  # spread by free capacity
        for _ in _polls(60):  # the per-node gauges on /metrics say so too
            busy = [v for v in a.metric("cir_node_sessions").values() if v > 0]
            if len(busy) >= 2:
                break
        assert len(busy) >= 2
        for sid, key in keys.items():
            assert _execute(a, sid, "y = 1\ny", key)["text"] == "1"
        ray_cluster.kill_node(extra.node_id)
        lost = [s for s in keys if nodes[s] == extra.node_id]
        kept = [s for s in keys if nodes[s] != extra.node_id]
        assert lost and kept, nodes
        for sid in lost:
            for replica in (a, b, a):  # the first call finds it lost; then both answer so
                with replica.client(keys[sid]) as api:
                    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "y"})
                assert r.status_code == 410, r.text
                assert r.json()["error"]["type"] == "SessionLost"
                assert "lost" in r.json()["error"]["message"]
        for sid in kept:
            assert _execute(b, sid, "y + 1", keys[sid])["text"] == "2"
            assert _execute(a, sid, "y + 2", keys[sid])["text"] == "3"
        # Ended for good: no record, and their places under the caps given back; a new
        # session starts (and clears what the lost ones left on the disk of the machine).
        for sid in lost:
            assert store.get_session(sid) is None
        assert store.slots_held() == len(kept)
        after = _create(b)
        keys[after] = KEY_A
        assert _execute(a, after, "3")["text"] == "3"
    finally:
        for sid, key in keys.items():
            _delete(a, sid, key)


@pytest.mark.cluster
def test_replica_process_wait_when_its_node_dies_ends_the_session(
    replicas: tuple[Replica, Replica], ray_cluster: RayTestCluster, store: SharedView
) -> None:
    import ray

    from sandbox.backends.ray_cluster.names import NAMESPACE

    a, b = replicas
    extra = ray_cluster.start_node(4)  # the emptiest: the session lands there
    sid = _create(a)
    try:
        record = store.get_session(sid)
        assert record is not None and record.sandbox_handle is not None
        assert _node_of(ray_cluster, store, sid) == extra.node_id
        with a.client() as api:
            started = api.post(f"/v1/sessions/{sid}/processes", json={"argv": ["sleep", "600"]})
        assert started.status_code == 201, started.text
        pid = started.json()["pid"]
        answers: list[httpx.Response] = []

        def wait() -> None:
            with b.client() as api:
                answers.append(api.post(f"/v1/sessions/{sid}/processes/{pid}/wait"))

        waiter = threading.Thread(target=wait)
        waiter.start()
        # The wait is under way in the actor (its process handle's call, not the lookup before
        # it: seen in flight twice in a row) before the node dies.
        actor = ray.get_actor(record.sandbox_handle, NAMESPACE)
        seen = 0
        for _ in _polls(60):
            seen = seen + 1 if ray.get(actor.idle_state.remote(), timeout=30)[1] >= 1 else 0
            if seen >= 2:
                break
        assert seen >= 2, "the wait never reached the session actor"
        ray_cluster.kill_node(extra.node_id)
        waiter.join(timeout=300)
        assert answers, "the wait did not answer"
        # Until the cluster has noticed the node is gone, the actor is only "not answering for
        # now" (503, try again): never a result, never a fresh session. Asked again, the wait
        # then answers that the session is lost.
        answer = answers[0]
        for _ in _polls(90):
            if answer.status_code != 503:
                break
            assert answer.json()["error"]["type"] == "BackendUnavailable", answer.text
            with b.client() as api:
                answer = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait")
        assert answer.status_code == 410, answer.text
        assert answer.json()["error"]["type"] == "SessionLost"
        for replica in (a, b):  # ended on both replicas, for good
            with replica.client() as api:
                r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})
            assert r.status_code == 410, r.text
            assert r.json()["error"]["type"] == "SessionLost"
        assert store.get_session(sid) is None
        # The dead node's sandbox left its directory in the state dir every node of this one
        # machine shares; the next session started on a live node clears it (as a restarted
        # node would its own), so the module ends with nothing left.
        _delete(a, _create(a))
    finally:
        _delete(a, sid)


@pytest.mark.cluster
def test_replica_killed_loses_nothing(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    sids: list[str] = []
    try:
        sids += [_create(a) for _ in range(2)]
        for n, sid in enumerate(sids):
            _execute(a, sid, f"kept = {n}")
        assert a.stop(signal.SIGKILL) == -signal.SIGKILL
        for n, sid in enumerate(sids):
            assert _execute(b, sid, "kept")["text"] == str(n)
        a.start()
        assert _execute(a, sids[0], "kept")["text"] == "0"
    finally:
        for sid in sids:
            _delete(b, sid)


@pytest.mark.cluster
def test_replica_idle_expiry_ends_a_session_once(
    replicas: tuple[Replica, Replica], store: SharedView
) -> None:
    a, b = replicas
    sid = _create(a)
    _execute(b, sid, "1")
    expired_before = sum(sum(r.metric("cir_sessions_expired_total").values()) for r in (a, b))
    # Its own idle expiry, as a front that makes forgettable sessions gives it (MCP's), and
    # ended when due (auto-pause, which these replicas could do: test_replica_pause.py).
    record = store.get_session(sid)
    assert record is not None
    store.put_session(record.model_copy(update={"idle_timeout_s": 1.0, "on_idle": "end"}))
    status = None
    for _ in _polls(120):
        with a.client() as api:
            status = api.get(f"/v1/sessions/{sid}").status_code
        if status == 410:
            break
    assert status == 410
    for replica in (a, b):
        with replica.client() as api:
            r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})
        assert r.status_code == 410 and r.json()["error"]["type"] == "SessionExpired"
        assert "expired after 1 s without activity" in r.json()["error"]["message"]

    # Counted by the replica that ended it once its sandbox is closed; its record forgotten.
    def expired() -> float:
        return sum(sum(r.metric("cir_sessions_expired_total").values()) for r in (a, b))

    for _ in _polls(120):
        if expired() > expired_before and store.get_session(sid) is None:
            break
    assert store.get_session(sid) is None
    assert expired() - expired_before == 1  # both reapers ran; one ended it


@pytest.mark.cluster
def test_replica_caps_hold_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def create(replica: Replica) -> None:
        with replica.client(KEY_CAPS) as api:
            r = api.post("/v1/sessions", json={})
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=create, args=(r,)) for r in (a, b) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [r.json()["id"] for r in answers if r.status_code == 201]
    refused = [r for r in answers if r.status_code != 201]
    try:
        assert len(made) == PER_KEY, [r.text for r in answers]
        assert all(r.status_code == 429 for r in refused)
        assert all(
            "API key holds its maximum of 3" in r.json()["error"]["message"] for r in refused
        )
        with b.client(KEY_CAPS) as api:
            assert sorted(s["id"] for s in api.get("/v1/sessions").json()) == sorted(made)
    finally:
        for sid in made:
            _delete(a, sid, KEY_CAPS)
    _delete(a, _create(b, KEY_CAPS), KEY_CAPS)  # the places were given back


@pytest.mark.cluster
def test_replica_host_tools_work_from_another_node(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    sid = _create(a, tools=["add", "slow"])
    try:
        ex = _execute(b, sid, "import host_tools\nhost_tools.sync.add(2)")
        assert ex["text"] == "4", ex
        ex = _execute(
            a, sid, "import asyncio\nawait asyncio.gather(*(host_tools.add(i) for i in range(5)))"
        )
        assert ex["text"] == "[2, 3, 4, 5, 6]", ex
    finally:
        _delete(b, sid)


@pytest.mark.cluster
def test_replica_keepalive_through_b_holds_off_the_idle_expiry(
    replicas: tuple[Replica, Replica], store: SharedView
) -> None:
    """The sandbox counts activity for every replica: a keepalive through B reaches it, so
    A's reaper leaves the kept session running while it ends one that nobody kept alive."""
    a, b = replicas
    kept, forgotten = _create(a), _create(a)
    try:
        for sid in (kept, forgotten):
            _execute(a, sid, "1")
            record = store.get_session(sid)
            assert record is not None
            store.put_session(record.model_copy(update={"idle_timeout_s": 4.0, "on_idle": "end"}))
        status = None
        for _ in _polls(120):
            with b.client() as api:
                r = api.post(f"/v1/sessions/{kept}/keepalive")
                assert r.status_code == 200, r.text
                assert r.json()["idle_expires_in_s"] > 0
            with a.client() as api:
                status = api.get(f"/v1/sessions/{forgotten}").status_code
            if status == 410:
                break
        assert status == 410, "the session nobody kept alive did not expire"
        assert _execute(a, kept, "2")["text"] == "2", "the keepalive through B did not hold"
    finally:
        _delete(a, kept)
        _delete(a, forgotten)


@pytest.mark.cluster
def test_replica_e2b_sdk_works_across_replicas(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's unmodified SDK: a sandbox made through A is run in, written to and commanded
    through B (data plane first, before any control-plane call there), its control plane
    answers on B, and a timeout set through B holds on every replica's sweep."""
    from e2b_code_interpreter import Sandbox

    from tests.e2b_sdk_fixtures import point_sdk_at

    a, b = replicas
    point_sdk_at(monkeypatch, a.url, KEY_A)
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url)  # made through A, its traffic to B
    extended = Sandbox.create(template="ray", timeout=15)
    left = Sandbox.create(template="ray", timeout=15)
    try:
        assert extended.run_code("x = 41\nx + 1").text == "42"
        extended.files.write("/home/user/f.txt", "hello")
        assert extended.commands.run("cat /home/user/f.txt").stdout == "hello"
        point_sdk_at(monkeypatch, b.url, KEY_A)  # the control plane through B
        assert Sandbox.get_info(extended.sandbox_id).sandbox_id == extended.sandbox_id
        Sandbox.set_timeout(extended.sandbox_id, 600)
        point_sdk_at(monkeypatch, a.url, KEY_A)  # everything through A again: the same sandbox
        on_a = Sandbox.connect(extended.sandbox_id)
        assert on_a.run_code("x").text == "41"
        assert on_a.files.read("/home/user/f.txt") == "hello"
        # Both had the same timeout; only the one not extended through B ends at it.
        for _ in _polls(120):
            if not left.is_running():
                break
        assert not left.is_running(), "the sandbox left at its timeout was not killed"
        assert extended.is_running(), "a replica's sweep killed at the deadline B moved"
        assert on_a.run_code("x").text == "41"
    finally:
        point_sdk_at(monkeypatch, a.url, KEY_A)
        for sandbox in (extended, left):
            with contextlib.suppress(Exception):
                Sandbox.kill(sandbox.sandbox_id)


@pytest.mark.cluster
def test_replica_signed_url_of_a_sandbox_made_elsewhere_opens_there_too(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed file URL names no sandbox: a replica finds the one made through another (its
    sweep adopts it, or, sooner, a walk of the store on a signature no known sandbox made)
    and reads and writes the link's path there."""
    import httpx
    from e2b_code_interpreter import Sandbox

    from tests.e2b_sdk_fixtures import point_sdk_at

    a, b = replicas
    point_sdk_at(monkeypatch, a.url, KEY_A)
    sandbox = Sandbox.create(template="ray")
    try:
        sandbox.files.write("/home/user/shared.txt", "from A")
        link = sandbox.download_url("/home/user/shared.txt").replace(a.url, b.url)
        assert link.startswith(b.url)
        got = httpx.get(link, timeout=60)
        assert got.status_code == 200 and got.text == "from A", got.text
        upload = sandbox.upload_url("/home/user/back.txt").replace(a.url, b.url)
        sent = httpx.post(upload, files={"file": ("back.txt", b"from B")}, timeout=60)
        assert sent.status_code == 200, sent.text
        assert sandbox.files.read("/home/user/back.txt") == "from B"
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sandbox.sandbox_id)


@pytest.mark.cluster
def test_replica_hung_store_stalls_neither_healthz_nor_a_cached_session(
    replicas: tuple[Replica, Replica], redis_url: str
) -> None:
    """Redis frozen (SIGSTOP: connections accepted, nothing answered): /healthz and a call on a
    session the replica holds answer while a store call is known to be pending; what needs the
    store answers 503 StoreUnavailable. The event loop never waits on Redis."""
    a, _ = replicas
    sid = _create(a)
    pending = threading.Event()
    answered = threading.Event()
    raw = redis.Redis.from_url(redis_url, socket_timeout=600)
    pid = int(raw.info("server")["process_id"])  # the module's own redis-server

    def hung_call() -> None:
        with contextlib.suppress(redis.RedisError):
            pending.set()
            raw.get("anything")
        answered.set()

    try:
        assert _execute(a, sid, "x = 41")["error"] is None  # held by replica a from now on
        os.kill(pid, signal.SIGSTOP)
        waiter = threading.Thread(target=hung_call)
        waiter.start()
        pending.wait()
        with a.client() as api:
            assert api.get("/healthz").status_code == 200
            r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x + 1"})
            assert r.status_code == 200, r.text
            created = api.post("/v1/sessions", json={})
            assert created.status_code == 503, created.text
            assert created.json()["error"]["type"] == "StoreUnavailable"
            assert api.get("/healthz").status_code == 200
        assert not answered.is_set()  # all of the above while Redis answered nothing
        assert [x["text"] for x in r.json()["results"] if x["is_main_result"]] == ["42"]
    finally:
        os.kill(pid, signal.SIGCONT)
        answered.wait(120)
        raw.close()
        _delete(a, sid)


@pytest.mark.cluster
def test_replica_reaper_ends_a_lost_session_no_replica_holds(
    replicas: tuple[Replica, Replica], store: SharedView
) -> None:
    """A record whose actor is gone, attached by no replica: a reaper finds it lost and ends it
    (before, it stayed until its maximum lifetime)."""
    from code_interpreter_wire.spec import SandboxSpec
    from orchestrator.auth import owner_of
    from sandbox.backends.ray_cluster.names import session_prefix

    _, b = replicas
    sid = f"s-{uuid.uuid4().hex[:24]}"
    handle = f"{session_prefix(ORCHESTRATOR_ID)}{sid}"  # no actor of that name lives
    owner = owner_of(KEY_A)
    assert store.admit(owner, sid, PER_KEY, 1000) is None
    record = SessionRecord(
        id=sid, owner=owner, backend="ray", spec=SandboxSpec(), sandbox_handle=handle
    )
    store.put_session(record)
    for _ in _polls(120):
        if store.get_session(sid) is None:
            break
    assert store.get_session(sid) is None, "no reaper ended the lost session"
    ended = store.ended(sid)
    assert ended is not None and ended[1].startswith("lost: ")
    with b.client() as api:
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})
    assert r.status_code == 410, r.text
    assert r.json()["error"]["type"] == "SessionLost"


@pytest.mark.cluster
def test_replica_session_reaches_only_its_allow_list_and_each_connection_is_audited_once(
    replicas: tuple[Replica, Replica], egress_upstream: Upstream
) -> None:
    """The proxy runs on the session's node; the records come to the replicas, each once."""
    a, b = replicas
    port = egress_upstream.port
    seen_before = len(egress_upstream.requests)
    before = sum(_egress_total(r) for r in (a, b))
    with a.client() as api:
        created = api.post("/v1/sessions", json={"network": [f"allowed.test:{port}"]})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
    try:
        code = FETCH + (
            f"print(json.dumps([fetch('http://allowed.test:{port}/hello'), "
            f"fetch('http://other.test:{port}/hello')]))"
        )
        ran = _execute(b, sid, code)  # through the other replica: the same proxy
        allowed, other = json.loads(ran["stdout"])
        assert allowed == [200, HELLO.decode()]
        assert other[0] == 403, other
        assert egress_upstream.requests[seen_before:] == [("GET", "/hello", f"allowed.test:{port}")]
        with b.client() as api:
            for _ in _polls(60):
                report = api.get(f"/v1/sessions/{sid}/network").json()
                if report["connections_allowed"] + report["connections_refused"] == 2:
                    break
            assert (report["connections_allowed"], report["connections_refused"]) == (1, 1)
            assert {c["host"] for c in report["connections"]} == {"allowed.test", "other.test"}
            for _ in _polls(60):
                audited = api.get(
                    "/v1/audit", params={"session_id": sid, "kind": "egress.connection"}
                ).json()["events"]
                if len(audited) >= 2:
                    break
        assert sorted((e["details"]["host"], e["status"]) for e in audited) == [
            ("allowed.test", "allowed"),
            ("other.test", "refused"),
        ]
        # Each record went to one replica: the two replicas' counts add up to two.
        assert sum(_egress_total(r) for r in (a, b)) - before == 2
    finally:
        with a.client() as api:
            assert api.delete(f"/v1/sessions/{sid}").status_code in (204, 410)


def _egress_total(replica: Replica) -> float:
    return sum(
        value
        for labels, value in replica.metric("cir_egress_connections_total").items()
        if 'backend="ray"' in labels
    )


@pytest.mark.cluster
def test_replica_volumes_are_shared_by_sessions_on_any_node_through_any_replica(
    replicas: tuple[Replica, Replica],
) -> None:
    """A volume made through A, written by a session on one node, read by a session made
    through B (wherever it runs), held by both (a delete through either is 409), deleted
    through B once they end: its directory is the shared `volumes_dir`, its holders too."""
    a, b = replicas
    with a.client() as api:
        made = api.post("/v1/volumes", json={"name": "shared", "size_mb": 16})
    assert made.status_code == 201, made.text
    volume = made.json()["id"]
    writer = _create(a, volumes=[{"volume_id": volume, "path": "/mnt/shared"}])
    reader = ""
    try:
        wrote = _execute(a, writer, "open('/mnt/shared/note.txt', 'w').write('from a node')")
        assert wrote["status"] == "ok", wrote
        mount = {"volume_id": volume, "path": "/data/shared", "read_only": True}
        reader = _create(b, volumes=[mount])
        read = _execute(b, reader, "print(open('/data/shared/note.txt').read())")
        assert read["stdout"] == "from a node\n", read
        for replica in (a, b):
            with replica.client() as api:
                refused = api.delete(f"/v1/volumes/{volume}")
                assert refused.status_code == 409, refused.text
                assert sorted(api.get(f"/v1/volumes/{volume}").json()["mounted_by"]) == sorted(
                    [writer, reader]
                )
        with b.client() as api:
            got = api.get(f"/v1/volumes/{volume}/files/note.txt")
            assert got.status_code == 200 and got.content == b"from a node"
    finally:
        _delete(a, writer)
        if reader:
            _delete(b, reader)
    with b.client() as api:
        assert api.delete(f"/v1/volumes/{volume}").status_code == 204
    with a.client() as api:
        assert api.get(f"/v1/volumes/{volume}").status_code == 404
