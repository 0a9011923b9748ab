"""The session actor: one detached Ray actor per session, on the node Ray placed it on. It owns a
sandbox of that node's own backend (`CIR_NODE_BACKEND`: bubblewrap or Docker) and serves every
Sandbox operation to whichever service replica calls; `RaySandbox` is its proxy.

It is made in two steps: the constructor only keeps its arguments (so that a replica can learn
fast whether Ray placed it at all), `start()` makes the sandbox. Every served call runs inside
`activity()`, which counts calls in flight and stamps the last one: what every replica's idle
reaper reads (`idle_state`); reading it is not activity. A warm pool's actor (warm_pool.py)
becomes a session once, through `hand_over`.

Nothing of a dead actor outlives it for long: a bubblewrap sandbox dies with the actor's
process (`--die-with-parent`); what stays on disk (its directories, its cgroup, a Docker
container) names the actor process that owned it, and the next actor to start on the node
sweeps what belongs to owners provably gone (`sweep_dead_owners`), never a live neighbour's.
Files move through the proxy in bounded chunks (`FILE_CHUNK_BYTES`), never a whole big file in
one Ray object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from code_interpreter_wire.errors import FileTooLarge, SandboxClosed, SandboxError, SandboxPausing
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import FileInfo, OutputEvent
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, Sandbox
from sandbox.backends.ray_cluster.names import NAMESPACE, node_backend_name, node_state_dir
from sandbox.backends.ray_cluster.node_egress import NodeEgress
from sandbox.backends.ray_cluster.node_machines import NodeMachines
from sandbox.backends.ray_cluster.node_processes import NodeProcesses
from sandbox.backends.ray_cluster.node_tool_relay import NodeToolRelay
from sandbox.backends.registry import backend_type, create_backend
from sandbox.process_identity import process_start_time

log = logging.getLogger(__name__)

FILE_CHUNK_BYTES = 4 << 20  # one Ray object of a file moving through the proxy
CHUNKS_UNREAD = 2  # chunks of an export the actor may be ahead of its reader
EXECUTE_EVENTS_UNREAD = 64  # outputs of an execution the actor may be ahead of its reader
MAX_IMPORTS = 4  # imports under way at once per session
MAX_EXPORTS = 4  # exports under way at once per session
IMPORT_IDLE_S = 600.0  # an import not written to for this long is dropped when another opens
FENCE_S = 120.0  # a pause's fence its replica never followed with a close lapses after this
_STAGING = "ray-staging"


@dataclass(frozen=True)
class SessionFacts:
    """What a replica learns of a session actor: where it is and what its sandbox speaks."""

    sandbox_id: str
    node_id: str
    address: str
    pid: int
    node_backend: str | None = None  # None until started
    languages: tuple[str, ...] = (PYTHON,)
    whole_saves: bool = False  # its node saves and restores whole machines (node_machines.py)


class SessionActor(NodeProcesses, NodeToolRelay, NodeEgress, NodeMachines):
    """Made with `ray.remote` where it is created (backend.py); one per session."""

    sandbox: Sandbox
    import_idle_s = IMPORT_IDLE_S

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        orchestrator_id: str,
        *,
        claimed: bool = True,
        namespace: str = NAMESPACE,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.spec = spec
        self.orchestrator_id = orchestrator_id
        self.namespace = namespace  # its name's (the service's actors' namespace)
        self._claimed = claimed  # a warm pool's actor is not, until one replica claims it
        self._backend: Backend | None = None
        self._node_backend: str | None = None
        self._in_flight = 0
        self._last_activity = time.monotonic()
        self._closed = False
        self._changes = 0  # calls that may change the sandbox's state, from every replica
        self._changing = 0  # ... of those, in flight
        self._fenced: str | None = None  # why calls are refused: a pause is taking it
        self._fence_lapses: asyncio.TimerHandle | None = None
        # token -> (staging file, bytes so far, when it was last written to)
        self._imports: dict[str, tuple[Path, int, float]] = {}
        self._exports = 0
        self._staging: Path | None = None
        self._shutting_down: asyncio.Task[None] | None = None

    # --- life -------------------------------------------------------------------------------

    async def start(self, restore: tuple[Path, str] | None = None) -> SessionFacts:
        """Make the node's backend and the session's sandbox; what a replica needs to know.
        `restore`: a saved machine (node_machines.py) it is woken from (`"wake"`) or forked
        from (`"fork"`) instead of a new sandbox."""
        if self._backend is not None:
            if restore is not None:
                raise SandboxError("this session's sandbox is already started")
            return self.describe()
        # Ray's workers run with SIGINT blocked; a blocked signal stays blocked across exec, so
        # the kernels started from here would never see an interrupt. The loop's thread starts
        # them: unblock it there.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        name = node_backend_name()
        state_dir = node_state_dir()
        config: dict[str, Any] = {"state_dir": state_dir}
        if backend_type(name).capabilities.labels_sandboxes:  # an engine others may share
            config["orchestrator_id"] = self.orchestrator_id
        backend = create_backend(name, **config)
        await sweep_dead_owners(backend, state_dir)
        self._backend, self._node_backend = backend, name
        try:
            if restore is None:
                self.sandbox = await backend.create(self.spec)
            elif restore[1] == "wake":
                self.sandbox = await backend.wake_from(restore[0], self.spec)
            else:
                self.sandbox = await backend.fork(restore[0], self.spec)
            await self.open_tool_relay()
        except BaseException:
            await self._shut_down()
            raise
        return self.describe()

    def describe(self) -> SessionFacts:
        context = ray.get_runtime_context()
        started = getattr(self, "sandbox", None)
        return SessionFacts(
            sandbox_id=self.sandbox_id,
            node_id=context.get_node_id(),
            address=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            pid=os.getpid(),
            node_backend=self._node_backend,
            languages=tuple(started.languages) if started is not None else (PYTHON,),
            whole_saves=self.whole_saves(),
        )

    async def hand_over(self, env: dict[str, str], workdir: str | None) -> SessionFacts | None:
        """Make a warm actor (warm_pool.py) the session of its first caller only; None to any
        other (or when it is not started, or closing). It then is what a fresh one would be:
        the session's environment added, its working directory set, and its idle clock
        starting now, not when the pool started it."""
        if self._claimed or self._closed or getattr(self, "sandbox", None) is None:
            return None
        self._claimed = True
        async with self.activity():
            if env:
                await self.sandbox.set_env(env)
                self.spec.env.update(env)
            if workdir is not None:
                await self.sandbox.set_workdir(workdir)
                self.spec.workdir = self.sandbox.spec.workdir
        return self.describe()

    async def close(self) -> None:
        """Close the sandbox, then end this actor's process (its slot goes back to the node),
        whether the sandbox closed cleanly or not: a detached actor left alive would hold its
        slot for ever. A second close waits for the first's shut-down, never ends the actor
        under it."""
        try:
            await self._shut_down()
        finally:
            ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    async def _shut_down(self) -> None:
        """Close everything once; every caller waits for that one shut-down."""
        self._closed = True
        if self._shutting_down is None:
            self._shutting_down = asyncio.ensure_future(self._close_all())
        await asyncio.shield(self._shutting_down)

    async def _close_all(self) -> None:
        with contextlib.suppress(Exception):
            await self.stop_egress()  # first: no connection outlives its sandbox's close
        with contextlib.suppress(Exception):
            await self.close_tool_relay()
        try:
            if getattr(self, "sandbox", None) is not None:
                await self.sandbox.close()
        finally:
            with contextlib.suppress(Exception):
                await self.drop_machines()
            if self._staging is not None:
                await asyncio.to_thread(shutil.rmtree, self._staging, True)
            if self._backend is not None:
                await self._backend.close()
            with contextlib.suppress(Exception):
                await self.drain_egress()  # last: replicas take the records left meanwhile

    # --- activity, shared by every replica ---------------------------------------------------

    @contextlib.asynccontextmanager
    async def activity(self, change: bool = False) -> AsyncIterator[None]:
        """Count a call in flight and stamp the last activity; refuse calls once closed, or
        fenced. `change`: the call may change the state a pause saves (counted for `fence`)."""
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        if self._fenced is not None:
            raise SandboxPausing(self._fenced)
        if change:
            self._changes += 1
            self._changing += 1
        self._in_flight += 1
        self._last_activity = time.monotonic()
        try:
            yield
        finally:
            self._in_flight -= 1
            if change:
                self._changing -= 1
            self._last_activity = time.monotonic()

    async def touch(self) -> None:
        """A keepalive: stamp the last activity, as a call would, so no replica's reaper finds
        the session idle (refused once closed, like any call)."""
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        self._last_activity = time.monotonic()

    async def changes(self) -> int:
        """How many calls that may change its state it has taken, from every replica."""
        return self._changes

    async def fence(self, expected_changes: int, why: str) -> bool:
        """Refuse every call from now on (`why` tells them), if it has taken exactly
        `expected_changes` such calls and none is in flight: a replica that saved its state
        makes sure no other replica changed it meanwhile before it stops the sandbox. False:
        one did (or does). A fence its replica never follows with `close` (it died) lapses
        after `FENCE_S`, and calls are taken again."""
        if self._closed or self._changes != expected_changes or self._changing:
            return False
        if self.holds_a_pause():  # a whole pause has it: its own steps end it
            return False
        self._fenced = why
        if self._fence_lapses is not None:
            self._fence_lapses.cancel()
        self._fence_lapses = asyncio.get_running_loop().call_later(FENCE_S, self._unfence)
        return True

    async def unfence(self) -> None:
        """A pause that fenced it failed after all: calls are taken again (not while a whole
        pause holds the machine: that one ends by its own steps, node_machines.py)."""
        if not self.holds_a_pause():
            self._unfence()

    def _unfence(self) -> None:
        self._fenced = None
        if self._fence_lapses is not None:
            self._fence_lapses.cancel()
            self._fence_lapses = None

    async def idle_state(self) -> tuple[float, int]:
        """(seconds since the last call ended, calls in flight); 0 idle while one runs."""
        idle = 0.0 if self._in_flight else time.monotonic() - self._last_activity
        return idle, self._in_flight

    # --- the sandbox ------------------------------------------------------------------------

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=EXECUTE_EVENTS_UNREAD)
    async def execute(
        self,
        code: str,
        timeout_s: float | None,
        env: dict[str, str] | None,
        cwd: str | None,
        language: str,
    ) -> AsyncIterator[OutputEvent]:
        """The execution's outputs as they happen, the last a DoneEvent. A reader that leaves
        cancels this generator, which interrupts the code (`Sandbox.stream`)."""
        async with self.activity(change=True):
            events: AsyncGenerator[OutputEvent, None] = self.sandbox.stream(  # type: ignore[assignment]
                code, timeout_s=timeout_s, env=env, cwd=cwd, language=language
            )
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()

    async def set_env(self, env: dict[str, str]) -> None:
        async with self.activity(change=True):
            await self.sandbox.set_env(env)

    async def set_workdir(self, path: str) -> None:
        async with self.activity(change=True):
            await self.sandbox.set_workdir(path)

    async def interrupt(self) -> bool:
        async with self.activity():
            return await self.sandbox.interrupt()

    async def restart(self, language: str | None) -> None:
        async with self.activity(change=True):
            await self.sandbox.restart(language)

    async def is_busy(self) -> bool:
        return self.sandbox.is_busy

    async def upload(self, path: str, data: bytes) -> FileInfo:
        async with self.activity(change=True):
            return await self.sandbox.upload(path, data)

    async def download(self, path: str, max_bytes: int) -> bytes:
        async with self.activity():
            return await self.sandbox.download(path, max_bytes=max_bytes)

    async def list_files(self, path: str, recursive: bool) -> list[FileInfo]:
        async with self.activity():
            return await self.sandbox.list_files(path, recursive=recursive)

    async def remove_file(self, path: str) -> None:
        async with self.activity(change=True):
            await self.sandbox.remove_file(path)

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=CHUNKS_UNREAD)
    async def export_chunks(self, path: str, max_bytes: int) -> AsyncIterator[bytes]:
        """A workspace file in chunks of at most FILE_CHUNK_BYTES: copied whole to the node's
        staging first (so the sandbox's files are read once, in its own bounded way), then
        read a chunk at a time as the replica takes them."""
        if self._exports >= MAX_EXPORTS:
            raise SandboxError(
                f"this session already has {MAX_EXPORTS} file exports under way; wait for one "
                "to end"
            )
        self._exports += 1
        try:
            async for chunk in self._export(path, max_bytes):
                yield chunk
        finally:
            self._exports -= 1

    async def _export(self, path: str, max_bytes: int) -> AsyncIterator[bytes]:
        async with self.activity():
            staged = await self._staging_dir() / f"export-{secrets.token_hex(8)}"
            try:
                await self.sandbox.export_file(path, staged, max_bytes=max_bytes)
                with staged.open("rb") as source:
                    while chunk := await asyncio.to_thread(source.read, FILE_CHUNK_BYTES):
                        yield chunk
            finally:
                staged.unlink(missing_ok=True)

    async def import_open(self) -> str:
        """Begin an import: a token to send its chunks with (`import_write`). Imports left
        idle for `import_idle_s` (their replica went away) are dropped first."""
        async with self.activity():
            now = time.monotonic()
            for token, (_, _, touched) in list(self._imports.items()):
                if now - touched >= self.import_idle_s:
                    log.info("dropped an import idle for %.0f s", now - touched)
                    await self.import_abort(token)
            if len(self._imports) >= MAX_IMPORTS:
                raise SandboxError(
                    f"this session already has {MAX_IMPORTS} file imports under way; wait for "
                    "one to end"
                )
            token = secrets.token_hex(8)
            staged = await self._staging_dir() / f"import-{token}"
            await asyncio.to_thread(staged.touch, mode=0o600)
            self._imports[token] = (staged, 0, time.monotonic())
            return token

    async def imports_under_way(self) -> list[str]:
        """The tokens of the imports under way (what the staging holds for them)."""
        return list(self._imports)

    async def import_write(self, token: str, chunk: bytes) -> None:
        async with self.activity():
            staged, size, _ = self._import(token)
            if len(chunk) > FILE_CHUNK_BYTES:
                raise SandboxError(f"an import chunk is at most {FILE_CHUNK_BYTES} bytes")
            size += len(chunk)
            limit = self.spec.limits.workspace_size_mb << 20
            if size > limit:
                await self.import_abort(token)
                raise FileTooLarge(f"the file is over the session's workspace size ({limit} bytes)")

            def append() -> None:
                with staged.open("ab") as sink:
                    sink.write(chunk)

            await asyncio.to_thread(append)
            if token in self._imports:
                self._imports[token] = (staged, size, time.monotonic())

    async def import_commit(self, token: str, path: str) -> FileInfo:
        """Move the staged file into the workspace at `path`."""
        async with self.activity(change=True):
            staged, _, _ = self._import(token)
            try:
                return await self.sandbox.import_file(path, staged)
            finally:
                await self.import_abort(token)

    async def import_abort(self, token: str) -> None:
        entry = self._imports.pop(token, None)
        if entry is not None:
            await asyncio.to_thread(entry[0].unlink, missing_ok=True)

    def _import(self, token: str) -> tuple[Path, int, float]:
        entry = self._imports.get(token)
        if entry is None:
            raise SandboxError("no such import under way (it ended or was never begun)")
        return entry

    async def _staging_dir(self) -> Path:
        """This actor's own staging directory on the node, named after its process so that a
        sweep can tell a dead one's (made off the event loop: a disk may be slow)."""
        if self._staging is None:
            self._staging = await asyncio.to_thread(_make_staging_dir)
        return self._staging


def _make_staging_dir() -> Path:
    pid = os.getpid()
    base = node_state_dir() / _STAGING
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base / f"{pid}.{process_start_time(pid)}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


async def sweep_dead_owners(backend: Backend, state_dir: Path) -> int:
    """Remove what session actors that died on this node left behind: sandbox directories,
    cgroups and containers whose owning process is provably gone, and staging directories of
    dead actor processes.

    This is the node's janitor, run as each actor starts. It never touches a live neighbour:
    the backend's `cleanup_orphans` removes only what is labelled with an owner process (pid,
    start time, boot, PID namespace) that no longer runs, and leaves alone what it cannot prove
    dead. Every actor is such an owner, so a live actor's sandbox is never an orphan.
    """
    removed = 0
    try:
        removed += await backend.cleanup_orphans()
    except Exception:
        log.exception("could not sweep the leftovers of dead sessions on this node")
    return removed + await asyncio.to_thread(_sweep_staging, state_dir / _STAGING)


def _sweep_staging(staging: Path) -> int:
    """Remove the staging directories of actor processes that no longer run."""
    removed = 0
    if staging.is_dir():
        for entry in staging.iterdir():
            pid, _, start = entry.name.partition(".")
            if pid.isdigit() and process_start_time(int(pid)) != start:
                shutil.rmtree(entry, True)
                removed += 1
    return removed
