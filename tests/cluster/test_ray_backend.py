"""The `ray` backend on a real 3-raylet Ray cluster on 127.0.0.1 (tests/cluster/conftest.py):
sessions spread over the nodes, every Sandbox operation through the actor's proxy, attach
from another backend object, a node lost takes exactly its sessions, a full cluster refuses
with the reason, warm pools, and nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import ray
from ray.exceptions import ActorUnavailableError

from code_interpreter_wire.errors import (
    BackendUnavailable,
    CapacityReached,
    FileMissing,
    SandboxError,
    SandboxLost,
    SandboxPausing,
)
from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.results import DoneEvent, ExecutionStatus, StdoutEvent
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.backends.ray_cluster.session_actor import (
    FILE_CHUNK_BYTES,
    MAX_IMPORTS,
    SessionActor,
)
from tests.cluster.conftest import RayTestCluster
from tests.conftest import host_processes_with, small_spec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ORCHESTRATOR_ID = "raytest"
WAIT_S = 60.0  # the longest any wait for the cluster here lasts: past it the test fails


async def until(check: object, what: str) -> None:
    """Poll `check` (a callable returning a bool or an awaitable of one) until it is true;
    fail, saying what was awaited, after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        result = check()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {WAIT_S} s for {what}")
        await asyncio.sleep(0.1)


def _config(cluster: RayTestCluster, **overrides: object) -> RayBackendConfig:
    fields: dict[str, object] = {
        "address": cluster.address,
        "orchestrator_id": ORCHESTRATOR_ID,
        "node_ip": "127.0.0.1",
        "placement_wait_s": 20.0,
    }
    fields.update(overrides)
    return RayBackendConfig.model_validate(fields)


@pytest.fixture(scope="module")
async def backend(ray_cluster: RayTestCluster) -> AsyncIterator[RayBackend]:
    made = RayBackend(_config(ray_cluster))
    yield made
    await made.close()


@contextlib.asynccontextmanager
async def sessions(backend: RayBackend, count: int) -> AsyncIterator[list[RaySandbox]]:
    made: list[RaySandbox] = []
    try:
        for _ in range(count):
            made.append(await backend.create(small_spec()))
        yield made
    finally:
        for sandbox in made:
            with contextlib.suppress(SandboxLost):
                await sandbox.close()


async def test_sessions_spread_and_run_through_the_proxy(
    backend: RayBackend, ray_cluster: RayTestCluster
) -> None:
    async with sessions(backend, 2) as (first, second):
        assert first.node_id != second.node_id  # the emptier node each time
        assert {first.node_id, second.node_id} <= {n.node_id for n in ray_cluster.nodes[1:]}
        assert first.backend == "ray" and first.handle.endswith(first.id)
        execution = await first.execute("x = 41\nx + 1")
        assert execution.ok and execution.text == "42"
        assert (await second.execute("'x' in dir()")).text == "False"  # apart

        events = [
            e async for e in first.stream("import time\nfor i in range(3):\n print(i, flush=True)")
        ]
        assert isinstance(events[-1], DoneEvent)
        assert "".join(e.text for e in events if isinstance(e, StdoutEvent)) == "0\n1\n2\n"

        await first.set_env({"GREETING": "hello"})
        assert (await first.execute("import os\nos.environ['GREETING']")).text == "'hello'"

        info = await first.upload("data/in.txt", b"payload")
        assert info.size == 7
        assert await first.download("data/in.txt") == b"payload"
        assert [f.path for f in await first.list_files("data")] == ["data/in.txt"]
        await first.remove_file("data/in.txt")
        with pytest.raises(FileMissing):
            await first.download("data/in.txt")

        running = first.stream("import time\nprint('on', flush=True)\ntime.sleep(600)")
        assert isinstance(await anext(running), StdoutEvent)
        assert await first.activity() == (0.0, 1)  # in use: never idle while a call runs
        await running.aclose()  # type: ignore[attr-defined]
        await until(lambda: _in_flight(first, 0), "the stream's end to reach the actor")
        idle, in_flight = await first.activity()
        assert in_flight == 0 and idle > 0.0


async def test_big_files_move_in_chunks(backend: RayBackend, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(bytes(range(256)) * (40 << 10))  # 10 MiB: three chunks
    async with sessions(backend, 1) as (sandbox,):
        info = await sandbox.import_file("big.bin", source)
        assert info.size == source.stat().st_size
        dest = tmp_path / "back.bin"
        assert await sandbox.export_file("big.bin", dest, max_bytes=64 << 20) == info.size
        assert dest.read_bytes() == source.read_bytes()

        # At most MAX_EXPORTS exports at once: each one held here after its first chunk
        # (the actor waits for its reader), the next is refused.
        held = [sandbox._actor.export_chunks.remote("big.bin", 64 << 20) for _ in range(4)]
        try:
            for generator in held:
                assert len(await (await anext(generator))) == FILE_CHUNK_BYTES
            refused = sandbox._actor.export_chunks.remote("big.bin", 64 << 20)
            with pytest.raises(SandboxError, match="4 file exports under way"):
                await (await anext(refused))
        finally:
            for generator in held:
                ray.cancel(generator)


async def test_abandoned_imports_expire(ray_cluster: RayTestCluster) -> None:
    """An import left idle past `import_idle_s` (0 here) is dropped, its staged file
    unlinked, when another opens: abandoned imports never use up a session's slots."""
    actor = ray.remote(QuickImportExpiry).remote("expiry", small_spec(), ORCHESTRATOR_ID)
    try:
        first = await actor.import_open.remote()
        await actor.import_write.remote(first, b"abandoned")
        staged = list(ray_cluster.state_dir.glob(f"ray-staging/*/import-{first}"))
        assert len(staged) == 1 and staged[0].read_bytes() == b"abandoned"
        for _ in range(MAX_IMPORTS + 1):  # more than the cap: each drops the idle ones
            last = await actor.import_open.remote()
        assert await actor.imports_under_way.remote() == [last]
        assert not staged[0].exists()
    finally:
        with contextlib.suppress(Exception):
            await actor.close.remote()
        ray.kill(actor)


class QuickImportExpiry(SessionActor):
    import_idle_s = 0.0


async def test_interrupt_restart_and_a_reader_that_leaves(backend: RayBackend) -> None:
    async with sessions(backend, 1) as (sandbox,):
        first_run = await sandbox.execute("kept = 1")
        assert first_run.ok, first_run
        assert (await sandbox.execute("kept")).text == "1"
        running = sandbox.stream("import time\nprint('started', flush=True)\ntime.sleep(600)")
        assert isinstance(await anext(running), StdoutEvent)  # the code runs now
        assert (await sandbox.activity())[1] == 1
        assert await sandbox.interrupt()
        done = [event async for event in running][-1]
        assert isinstance(done, DoneEvent)
        stopped = done.execution
        assert stopped.status is ExecutionStatus.CANCELLED, stopped
        again = await sandbox.execute("kept")
        assert again.text == "1", (stopped.error, again.error)  # the kernel lives on

        # A consumer that leaves mid-stream interrupts the code on the node.
        stream = sandbox.stream("import time\nprint('go', flush=True)\ntime.sleep(600)")
        first = await anext(stream)
        assert isinstance(first, StdoutEvent)
        await stream.aclose()
        after = await sandbox.execute("kept + 1")
        assert after.text == "2", after

        await sandbox.restart()
        gone = await sandbox.execute("kept")
        assert gone.status is ExecutionStatus.ERROR and "NameError" in gone.error.name


async def test_attach_from_another_backend(
    backend: RayBackend, ray_cluster: RayTestCluster
) -> None:
    other = RayBackend(_config(ray_cluster))
    try:
        async with sessions(backend, 1) as (sandbox,):
            await sandbox.execute("shared = 'from A'")
            attached = await other.attach(sandbox.handle, sandbox.spec)
            assert attached.id == sandbox.id and attached.node_id == sandbox.node_id
            assert (await attached.execute("shared")).text == "'from A'"
            await attached.upload("b.txt", b"from B")
            assert await sandbox.download("b.txt") == b"from B"
            assert sandbox.handle in await other.list_sandboxes()
        with pytest.raises(SandboxLost, match="was ended") as ended:
            await other.attach(sandbox.handle, sandbox.spec)  # closed: gone for good
        assert sandbox.node_id[:16] in str(ended.value)  # where it was, from the cluster
        with pytest.raises(SandboxError, match="names no session of this service"):
            await other.attach("cir:someone-else:abc", sandbox.spec)
    finally:
        await other.close()


async def test_a_save_is_fenced_against_other_replicas_changes(
    backend: RayBackend, ray_cluster: RayTestCluster
) -> None:
    """Two replicas' proxies on one session actor: one saving it for a pause may stop it only
    if the other changed nothing meanwhile (its own calls count as its own); once fenced,
    the other's calls are refused saying why, until an unfence."""
    other = RayBackend(_config(ray_cluster))
    try:
        async with sessions(backend, 1) as (pausing,):
            elsewhere = await other.attach(pausing.handle, pausing.spec)
            mark = await pausing.fence_mark()
            await pausing.execute("saved = 1")  # the pausing replica's own save
            await elsewhere.upload("late.txt", b"changed meanwhile")
            assert not await pausing.fence(mark, "being paused")
            assert (await elsewhere.execute("saved")).text == "1"  # nothing was refused
            mark = await pausing.fence_mark()
            await pausing.execute("saved = 2")
            await elsewhere.list_files("")  # reading changes nothing
            assert await pausing.fence(mark, "being paused; call again")
            with pytest.raises(SandboxPausing, match="being paused; call again"):
                await elsewhere.execute("saved")
            await pausing.unfence()
            assert (await elsewhere.execute("saved")).text == "2"
            # A change in flight from before the mark (its count is in the mark): still not
            # fenced, since what it does next would be lost.
            running = elsewhere.stream("import time\nprint('on', flush=True)\ntime.sleep(600)")
            assert isinstance(await anext(running), StdoutEvent)
            mark = await pausing.fence_mark()
            assert not await pausing.fence(mark, "being paused")
            await running.aclose()  # type: ignore[attr-defined]
            await until(lambda: _in_flight(pausing, 0), "the stream's end to reach the actor")
            assert await pausing.fence(await pausing.fence_mark(), "being paused")
    finally:
        await other.close()


async def test_network_is_refused(backend: RayBackend) -> None:
    spec = SandboxSpec(network=NetworkPolicy(mode="any"))
    with pytest.raises(SandboxError, match="no network"):
        await backend.create(spec)


async def test_a_full_cluster_says_why(backend: RayBackend) -> None:
    capacity = sum(node.capacity for node in await backend.nodes() if node.alive)

    async def all_free() -> bool:
        return sum(node.free for node in await backend.nodes()) == capacity

    await until(all_free, "every slot of the cluster to be free")
    async with sessions(backend, capacity) as made:
        assert len(made) == capacity
        with pytest.raises(CapacityReached, match=r"every node .* maximum of sessions") as err:
            await backend.create(small_spec())
        assert "try again later or add a node" in str(err.value)


async def test_a_node_lost_takes_exactly_its_sessions(
    backend: RayBackend, ray_cluster: RayTestCluster
) -> None:
    extra = ray_cluster.start_node(3)  # the emptiest: the next sessions land there first
    async with sessions(backend, 4) as made:
        doomed = [s for s in made if s.node_id == extra.node_id]
        kept = [s for s in made if s.node_id != extra.node_id]
        assert doomed and kept, [s.node_id for s in made]
        for sandbox in made:
            await sandbox.execute("y = 1")
        # An execution streaming as its node dies ends in SandboxLost, never an empty result.
        streaming = doomed[0].stream(
            "import time\nwhile True:\n print('.', flush=True)\n time.sleep(0.1)"
        )
        assert isinstance(await anext(streaming), StdoutEvent)
        ray_cluster.kill_node(extra.node_id)
        with pytest.raises((SandboxLost, BackendUnavailable)) as first_error:
            async for event in streaming:
                assert not isinstance(event, DoneEvent), event
        for sandbox in doomed:
            # Until the cluster has noticed the node's death, "unavailable" (retryable), never
            # an empty result; then lost, with where and why.
            await until(lambda s=sandbox: _lost_yet(s), "the doomed session to be found lost")
            with pytest.raises(SandboxLost, match="lost") as lost:
                await sandbox.execute("y")
            assert extra.node_id[:16] in str(lost.value)
            assert "is up" not in str(lost.value), lost.value
            with pytest.raises(SandboxLost):  # and from then on, at once
                await sandbox.list_files()
        assert isinstance(first_error.value, SandboxError)
        for sandbox in kept:
            assert (await sandbox.execute("y")).text == "1"
        other = RayBackend(_config(ray_cluster))
        try:
            for sandbox in doomed:
                with pytest.raises(SandboxLost) as attached:
                    await (await other.attach(sandbox.handle, sandbox.spec)).execute("y")
                assert extra.node_id[:16] in str(attached.value), attached.value  # where
        finally:
            await other.close()
        # The actors' processes died with their raylet, and their sandboxes with them...
        for sandbox in doomed:
            await _gone(sandbox.facts.pid)
        assert not [
            p for p in host_processes_with("bwrap") if _parent(p) in {s.facts.pid for s in doomed}
        ]
        # ...and what they left on disk goes with the next session that starts on the machine.
        async with sessions(backend, 1):
            assert len(_sandbox_dirs(ray_cluster)) == len(kept) + 1
    nodes = {node.node_id: node for node in await backend.nodes()}
    assert not nodes[extra.node_id].alive


async def test_an_unavailable_actor_is_lost_only_when_the_cluster_says_so(
    backend: RayBackend,
) -> None:
    """`ActorUnavailableError` ("temporarily unavailable") of an actor the cluster has alive
    is a retryable BackendUnavailable and the session stays; of a dead one, SandboxLost."""
    async with sessions(backend, 1) as (sandbox,):
        actor_id = sandbox._actor._actor_id.binary()
        blip = ActorUnavailableError("RpcError: connection refused", actor_id)
        with pytest.raises(BackendUnavailable, match="does not answer for now"):
            await sandbox.raise_as_sandbox_error(blip)
        assert sandbox.lost is None
        assert (await sandbox.execute("6 * 7")).text == "42"

        ray.kill(sandbox._actor, no_restart=True)
        with pytest.raises(SandboxLost, match="actor died") as lost:
            await sandbox.raise_as_sandbox_error(blip)
        assert sandbox.node_id[:16] in str(lost.value) and "ray.kill" in str(lost.value)
        assert sandbox.lost == str(lost.value)
        with pytest.raises(SandboxLost):
            await sandbox.execute("1")
    # What the killed actor left on disk goes with the next session to start.
    await _gone(sandbox.facts.pid)
    async with sessions(backend, 1):
        pass


async def _in_flight(sandbox: RaySandbox, count: int) -> bool:
    return (await sandbox.activity())[1] == count


async def _lost_yet(sandbox: RaySandbox) -> bool:
    with contextlib.suppress(BackendUnavailable, SandboxLost):
        await sandbox.execute("y")
    return sandbox.lost is not None


async def _gone(pid: int) -> None:
    """Wait for a process to end (zombies count as ended)."""
    await until(lambda: _parent(pid) is None or _zombie(pid), f"process {pid} to end")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _sandbox_dirs(cluster: RayTestCluster) -> list[Path]:
    base = cluster.state_dir / "local"
    return list(base.iterdir()) if base.is_dir() else []


# A driver that joins the cluster from its loop's worker thread, as the service does, with a
# SIGTERM handler of its own (as uvicorn's); told to stop, it takes longer than Ray's crash
# handler's alarm (3 s) to finish, as a graceful shutdown may.
_SLOW_TO_STOP = """
import asyncio, os, signal, sys
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig

async def main() -> None:
    told = asyncio.Event()
    signal.signal(signal.SIGTERM, lambda *_: told.set())
    backend = RayBackend(RayBackendConfig(address=sys.argv[1], node_ip="127.0.0.1",
                                          orchestrator_id="sigterm"))
    await backend.nodes()  # joins the cluster
    print("joined", flush=True)
    while not told.is_set():
        await asyncio.sleep(0.05)
    await asyncio.sleep(5)
    await backend.close()
    print("stopped cleanly", flush=True)

asyncio.run(main())
"""


@pytest.mark.cluster
def test_a_driver_told_to_stop_shuts_down_at_its_own_pace(
    ray_cluster: RayTestCluster, tmp_path: Path
) -> None:
    """Ray's crash handler takes SIGTERM for a crash and aborts the process 3 s later; the
    backend gives the signal back to the process's own handler when it joins."""
    import os
    import signal
    import subprocess
    import sys

    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:  # a file, not a pipe: nothing unread can stall the driver
        driver = subprocess.Popen(
            [sys.executable, "-c", _SLOW_TO_STOP, ray_cluster.address],
            env={**os.environ, **ray_cluster.env},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "joined", errors.read_text()[-3000:]
        driver.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=60)
    err = errors.read_text()
    assert driver.returncode == 0, err[-3000:]
    assert out.strip() == "stopped cleanly"
    assert "SIGTERM received" not in err  # Ray's crash handler never saw it
