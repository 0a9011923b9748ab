"""Whole machines of Ray sessions on gVisor nodes (node_machines.py, machine_store.py): a snapshot
forked onto both nodes, re-keyed; a pause whose image outlives the node that paused it, woken on
the other with its kernel's variables, its files and its processes; a pause whose image cannot
be carried runs on, nothing lost.

A cluster of its own (a head and two gVisor worker nodes), so that every session lands on a
node that saves machines; the test process joins it as the ray backend's driver, and leaves it
before the shared cluster of the other modules starts (conftest.py orders them).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.backend import PARTIAL_AFTER_S, RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.local_cluster import LocalCluster, local_cluster
from sandbox.backends.ray_cluster.loopback import LOOPBACK
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from tests.cluster.conftest import HEALTH_CHECK_MS, RUN_TOKEN
from tests.cluster.redis_server import free_port, redis_server
from tests.cluster.test_replicas import KEY_A, Replica, _create, _delete, _execute
from tests.conftest import require_backend

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

GVISOR_NODE = {"CIR_NODE_BACKEND": "gvisor"}
ORPHAN = "0dd0c0ffee"  # a paused machine's image nobody recorded (its token)
KEPT = "0dd0c0ffef"  # one nobody recorded, paused from a sandbox a record names
# Far longer than a session's creation or pause takes here, short enough to wait for.
ORPHAN_AFTER_S = 40
SETUP = """
import secrets, subprocess
held = secrets.token_hex(8)
sleeper = subprocess.Popen(["sleep", "600"])
open("kept.txt", "w").write(held)
print(held)
"""
CHECK = """
import secrets
print(held, sleeper.poll() is None, open("kept.txt").read() == held, secrets.token_hex(8))
"""


@pytest.fixture(scope="module")
def gvisor_cluster() -> Iterator[LocalCluster]:
    require_backend("gvisor")
    with local_cluster(
        (0,), token=RUN_TOKEN, health_check_ms=HEALTH_CHECK_MS, prefix="cir-gm-"
    ) as cluster:
        for _ in range(2):
            cluster.start_node(2, env=GVISOR_NODE)
        yield cluster


@pytest.fixture(scope="module")
def gvisor_replicas(
    gvisor_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, Replica, Path]]:
    """Two replicas of the service over a Redis with a password, sharing a saved-states
    directory (a shared volume in production), on the gVisor nodes; and that directory."""
    root = tmp_path_factory.mktemp("gvisor-replicas")
    root.chmod(0o711)
    saved_states = root / "saved-states"
    with redis_server(root / "redis") as url:
        made: list[Replica] = []
        try:
            for name in ("a", "b"):
                env = {
                    **os.environ,
                    **gvisor_cluster.env,
                    "CODE_INTERPRETER_API_KEYS": KEY_A,
                    "CODE_INTERPRETER_STATE_DIR": str(root / name),
                    "CODE_INTERPRETER_ORCHESTRATOR_ID": "machines-replicas",
                    "CODE_INTERPRETER_RAY_NODE_IP": "127.0.0.1",
                    "CODE_INTERPRETER_SAVED_STATES_DIR": str(saved_states),
                    "CODE_INTERPRETER_CLUSTER_ORPHAN_AFTER_S": str(ORPHAN_AFTER_S),
                }
                port = free_port()
                argv = [
                    sys.executable, "-m", "orchestrator", "serve", "--port", str(port),
                    "--backend", "ray", "--ray-address", gvisor_cluster.address, "--store", url,
                ]  # fmt: skip
                log = root / f"{name}.log"
                made.append(Replica(name, argv, env, port, log, gvisor_cluster.root).start())
            yield made[0], made[1], saved_states
        finally:
            for replica in made:
                if replica.process is not None:
                    replica.stop()


def test_replica_pauses_a_machine_whole_and_the_other_resumes_it(
    gvisor_replicas: tuple[Replica, Replica, Path],
) -> None:
    """Through the service: paused through A (the record keeps the machine's handle, its image
    in the shared directory), resumed by a call through B with its variables, files and
    running process; a snapshot of it forked through A, whole; deleted while paused, its
    image goes."""
    a, b, saved_states = gvisor_replicas
    paused_machines = saved_states / "code-interpreter-paused-machines"

    def images() -> list[Path]:
        return [p for p in paused_machines.iterdir() if p.is_dir() and p.name != ORPHAN]

    sid = _create(a)
    try:
        held = _execute(a, sid, SETUP)["stdout"].strip()
        with a.client() as api:
            paused = api.post(f"/v1/sessions/{sid}/pause")
            assert paused.status_code == 200, paused.text
        assert len(images()) == 1
        resumed = _execute(b, sid, CHECK)
        value, running, kept, _ = resumed["stdout"].split()
        assert (value, running, kept) == (held, "True", "True")
        assert "whole sandbox" in (resumed["notice"] or ""), resumed["notice"]
        assert images() == []

        with b.client() as api:
            taken = api.post(f"/v1/sessions/{sid}/snapshots", json={"name": "whole"})
            assert taken.status_code == 201, taken.text
            snapshot_id = taken.json()["id"]
        fork = _create(a, snapshot_id=snapshot_id)
        try:
            value, running, kept, _ = _execute(a, fork, CHECK)["stdout"].split()
            assert (value, running, kept) == (held, "True", "True")
        finally:
            _delete(a, fork)
        with a.client() as api:
            assert api.delete(f"/v1/snapshots/{snapshot_id}").status_code == 204

        with a.client() as api:
            assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        [image] = images()
        # Beside it, an image no record names, as a replica killed between storing it and
        # recording its pause leaves: the replicas' orphan sweep removes it (seen so twice,
        # ORPHAN_AFTER_S apart); the paused session's, there as long, stays; and so does one
        # no record names but paused from a sandbox a record names (a pause whose record
        # could not be written: the session's state).
        (paused_machines / ORPHAN).mkdir()
        kept = paused_machines / KEPT
        kept.mkdir()
        tag = paused_machines / f".{image.name}.from"
        (paused_machines / f".{KEPT}.from").write_text(tag.read_text())
        deadline = time.monotonic() + 6 * ORPHAN_AFTER_S
        while (paused_machines / ORPHAN).exists():
            assert time.monotonic() < deadline, "the sweep left an image nobody recorded"
            time.sleep(1)
        assert image.exists() and kept.exists()
        kept.rmdir()
        (paused_machines / f".{KEPT}.from").unlink()
        value, running, kept, _ = _execute(b, sid, CHECK)["stdout"].split()
        assert (value, running, kept) == (held, "True", "True")
        with a.client() as api:
            assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        assert len(images()) == 1
    finally:
        _delete(b, sid)
    assert list(paused_machines.iterdir()) == [], "a deleted session's machine stayed"


@pytest.fixture
async def machines_backend(
    gvisor_cluster: LocalCluster, tmp_path: Path
) -> AsyncIterator[RayBackend]:
    backend = RayBackend(
        RayBackendConfig(
            address=gvisor_cluster.address,
            node_ip=LOOPBACK,
            orchestrator_id="machines",
            machine_images_dir=tmp_path / "machines",
        )
    )
    try:
        yield backend
    finally:
        await backend.close()


async def printed(sandbox: RaySandbox, code: str) -> str:
    execution = await sandbox.execute(code, timeout_s=120)
    assert execution.error is None, execution.error
    return execution.stdout.strip()


async def test_a_snapshot_forks_onto_both_nodes_and_a_pause_outlives_its_node(
    gvisor_cluster: LocalCluster, machines_backend: RayBackend, tmp_path: Path
) -> None:
    backend = machines_backend
    spec = SandboxSpec()
    first = await backend.create(spec)
    try:
        assert first.facts.whole_saves
        held = await printed(first, SETUP)

        # A snapshot, carried off its node and forked from the replica's copy into every slot
        # left (one beside it, two on the other node): each fork runs on as the machine was,
        # and draws random numbers of its own.
        saved = await first.save_whole(tmp_path / "snapshot", max_bytes=4 << 30)
        assert saved is not None and saved.machine
        forks: list[RaySandbox] = []
        try:
            for _ in range(3):
                forks.append(await backend.fork(tmp_path / "snapshot", spec))
            assert len({fork.node_id for fork in forks}) == 2, "the forks took one node only"
            draws = set()
            for fork in [*forks, first]:
                value, running, kept, draw = (await printed(fork, CHECK)).split()
                assert (value, running, kept) == (held, "True", "True")
                draws.add(draw)
            assert len(draws) == 4, "a fork drew the same random numbers as another"
        finally:
            for fork in forks:
                await fork.close()

        # A pause: the machine stops, its image goes to the store; nothing of it stays on the
        # node, which then dies. It wakes on the other node, whole.
        handle = await first.suspend()
        assert handle is not None
        paused_on = first.node_id
        # The orphan sweep sees it (and ends it if no record names it, nor the sandbox it was
        # paused from, for long enough).
        assert handle in await backend.list_sandboxes()
        assert await backend.paused_from({handle, "machine-none"}) == {handle: first.handle}
    finally:
        await first.close()
    token = handle.removeprefix("machine-")
    assert sorted(p.name for p in (tmp_path / "machines").iterdir()) == [f".{token}.from", token]
    gvisor_cluster.kill_node(paused_on)
    deadline = time.monotonic() + 60
    while any(node.node_id == paused_on and node.alive for node in await backend.nodes()):
        assert time.monotonic() < deadline, "the killed node was never seen dead"
        await asyncio.sleep(0.5)

    woken = await backend.wake(handle, spec)
    try:
        assert woken.node_id != paused_on
        value, running, kept, _ = (await printed(woken, CHECK)).split()
        assert (value, running, kept) == (held, "True", "True")
        # Kept until the service has recorded it running: a resume failing after the wake
        # can wake it again.
        assert (tmp_path / "machines" / token).is_dir()
        await backend.woken(handle)
        assert list((tmp_path / "machines").iterdir()) == [], "a woken image stayed in the store"
        assert handle not in await backend.list_sandboxes()
    finally:
        await woken.close()


async def test_images_a_crash_left_half_carried_are_removed_at_start(
    machines_backend: RayBackend, tmp_path: Path
) -> None:
    """A replica killed while carrying an image in leaves it half made, named by nobody: the
    next start removes it once no carrying could still be under way; a whole image (the orphan
    sweep's to judge, by the records) and a carrying under way stay."""
    store = tmp_path / "machines"
    store.mkdir()
    stale, under_way, whole = store / ".0a1b.5e6f.new", store / ".2c3d.7a8b.new", store / "4e5f"
    for directory in (stale, under_way, whole):
        directory.mkdir()
        (directory / "pages").write_bytes(b"x")
    long_ago = time.time() - PARTIAL_AFTER_S - 60
    for path in (stale / "pages", stale):
        os.utime(path, (long_ago, long_ago))
    os.utime(under_way, (long_ago, long_ago))  # a file in it written just now: under way
    assert await machines_backend.cleanup_orphans() == 1
    assert sorted(p.name for p in store.iterdir()) == [under_way.name, whole.name]
    assert "machine-4e5f" in await machines_backend.list_sandboxes()
    await machines_backend.discard("machine-4e5f")
    assert "machine-4e5f" not in await machines_backend.list_sandboxes()


async def test_a_pause_whose_image_cannot_be_carried_runs_on(
    gvisor_cluster: LocalCluster, tmp_path: Path
) -> None:
    """The store cannot take the image (here: its directory cannot be made): the machine runs
    again on its node as it was, and the pause falls back to the kernel's state (None)."""
    (tmp_path / "a-file").write_text("")
    backend = RayBackend(
        RayBackendConfig(
            address=gvisor_cluster.address,
            node_ip=LOOPBACK,
            orchestrator_id="machines",
            machine_images_dir=tmp_path / "a-file" / "machines",
        )
    )
    try:
        sandbox = await backend.create(SandboxSpec())
        try:
            held = await printed(sandbox, SETUP)
            assert await sandbox.suspend() is None
            value, running, kept, _ = (await printed(sandbox, CHECK)).split()
            assert (value, running, kept) == (held, "True", "True")
        finally:
            await sandbox.close()
    finally:
        await backend.close()
