"""The replica's side of a session: a Sandbox whose every call goes to its session actor.

Every call awaits the actor's ref (never `ray.get` in the event loop); a caller that leaves
cancels the actor's call. The actor's own errors come back as it raised them (a missing file is
`FileMissing` here too). An actor gone (its process or its node died, or it was killed) is
`SandboxLost` saying why, from then on, for every call (its processes' calls too:
remote_process.py reports through `raise_as_sandbox_error`): a session actor is never restarted
(`max_restarts=0`), so nothing could answer in its name but a fresh, empty kernel, and an
execution is never answered with an empty result. An actor only out of reach for now (the
cluster still has it and its node alive) is `BackendUnavailable`, and the session stays
(actor_errors.py decides which).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import ray
from ray.exceptions import RayActorError

from code_interpreter_wire.errors import ProcessesUnsupported, SandboxError, SandboxLost
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest
from code_interpreter_wire.results import DoneEvent, EventSink, Execution, FileInfo, OutputEvent
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Sandbox
from sandbox.backends.ray_cluster.actor_errors import (
    actor_id_of,
    is_actor_failure,
    known_fate,
    lost_reason,
    sandbox_error_of,
)
from sandbox.backends.ray_cluster.machine_store import MachineStore, image_cap, receive_tree
from sandbox.backends.ray_cluster.node_machines import MachineWokeAgain
from sandbox.backends.ray_cluster.session_actor import FILE_CHUNK_BYTES, SessionFacts
from sandbox.egress import EgressSettings
from sandbox.egress.outbox import EgressBatch, EgressReport
from sandbox.egress.slots import SharedCaps
from sandbox.processes.handle import ProcessHandle
from sandbox.saved_report import SavedState, StateTooLarge
from sandbox.tree_transfer import TreeRefused

log = logging.getLogger(__name__)

T = TypeVar("T")
# A session actor's handle: Ray types an actor's methods as reached by name only.
ActorRef = Any
CLOSE_WAIT_S = 30.0  # the longest a close waits for the actor to close its sandbox; then killed
KILL_WAIT_S = 10.0  # the longest a close waits for the GCS to take the kill
# How long a machine paused on its node waits for its replica's next step (a batch of its
# image taken, the end) before it runs again there: the replica died mid-pause.
PAUSE_LAPSE_S = 60.0


class RaySandbox(Sandbox):
    backend = "ray"

    def __init__(
        self,
        actor: ActorRef,
        name: str,
        spec: SandboxSpec,
        facts: SessionFacts,
        machines: MachineStore | None = None,
    ) -> None:
        self._actor = actor
        self._machines = machines  # where a paused whole machine waits (None: no such pause)
        self._name = name
        self.id = facts.sandbox_id
        self.spec = spec
        self.facts = facts
        self._lost: str | None = None
        self._running = 0
        self._closed = False
        self._changes_sent = 0  # calls that may change its state this proxy made (`fence`)

    @property
    def handle(self) -> str:
        """The session actor's name: any replica attaches by it (`RayBackend.attach`)."""
        return self._name

    @property
    def node_id(self) -> str:
        return self.facts.node_id

    @property
    def languages(self) -> list[str]:
        return list(self.facts.languages)

    @property
    def is_busy(self) -> bool:
        """Whether this replica has an execution running in it (others' are not known here)."""
        return self._running > 0

    # --- every call -------------------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why the session is lost (None while it is not): the reason every later call gets."""
        return self._lost

    async def _call(self, ref: Awaitable[T], *, while_closing: bool = False) -> T:
        """The actor's answer to a call; `while_closing`: asked even once this proxy closed
        the sandbox (the actor answers until it is gone)."""
        if while_closing:
            if self._lost is not None:
                raise SandboxLost(self._lost)
        else:
            self.check_not_lost()
        try:
            return await ref
        except asyncio.CancelledError:
            _cancel(ref)
            raise
        except Exception as exc:
            await self.raise_as_sandbox_error(exc)

    def check_not_lost(self) -> None:
        """`SandboxLost` at once once lost; SandboxError once closed."""
        if self._lost is not None:
            raise SandboxLost(self._lost)
        if self._closed:
            raise SandboxError("the sandbox was closed")

    async def raise_as_sandbox_error(self, exc: BaseException) -> NoReturn:
        """A failed call of the actor (this sandbox's, or one of its processes') as the sandbox
        layer's error; a loss is recorded here, with its reason, for every later call."""
        if self._lost is not None and is_actor_failure(exc):
            raise SandboxLost(self._lost) from None
        error = await sandbox_error_of(exc, self._name, self.facts, actor_id_of(self._actor))
        if isinstance(error, SandboxLost) and self._lost is None:
            self._lost = str(error)
        if error is exc:
            raise error
        raise error from None

    async def _raise_lost(self, exc: BaseException) -> NoReturn:
        if self._lost is None:
            fate = await known_fate(actor_id_of(self._actor))
            self._lost = await lost_reason(self._name, self.facts, exc, fate)
        raise SandboxLost(self._lost) from None

    # --- code -------------------------------------------------------------------------------

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        language: str = PYTHON,
    ) -> Execution:
        stream = cast(
            AsyncGenerator[OutputEvent, None],
            self.stream(code, timeout_s=timeout_s, env=env, cwd=cwd, language=language),
        )
        async with contextlib.aclosing(stream) as events:  # on_event raising ends it too
            async for event in events:
                if isinstance(event, DoneEvent):
                    return event.execution
                if on_event is not None:
                    await on_event(event)
        raise SandboxLost(f"the session actor {self._name} ended an execution without its result")

    async def stream(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        language: str = PYTHON,
    ) -> AsyncIterator[OutputEvent]:
        """The actor's outputs as they happen, the last `done`; leaving early cancels the
        actor's generator, which interrupts the code there."""
        self.check_not_lost()
        self._changes_sent += 1
        generator = self._actor.execute.remote(code, timeout_s, env, cwd, language)
        self._running += 1
        finished = False
        try:
            async for ref in generator:
                event: OutputEvent = await self._call(ref)
                yield event
                if isinstance(event, DoneEvent):
                    finished = True
                    return
        except SandboxError:
            finished = True
            raise
        except Exception as exc:
            finished = True
            await self.raise_as_sandbox_error(exc)
        finally:
            self._running -= 1
            if not finished:
                _cancel(generator)
        # The stream ended with no `done`: the actor went away between two outputs.
        await self._raise_lost(RuntimeError("the execution's stream ended without its result"))

    async def set_env(self, env: dict[str, str]) -> None:
        self._changes_sent += 1
        await self._call(self._actor.set_env.remote(env))
        self.spec.env.update(env)

    async def set_workdir(self, path: str) -> None:
        self._changes_sent += 1
        await self._call(self._actor.set_workdir.remote(path))
        await super().set_workdir(path)

    async def interrupt(self) -> bool:
        return await self._call(self._actor.interrupt.remote())

    async def restart(self, language: str | None = None) -> None:
        self._changes_sent += 1
        await self._call(self._actor.restart.remote(language))

    # --- files ------------------------------------------------------------------------------

    async def upload(self, path: str, data: bytes) -> FileInfo:
        self._changes_sent += 1
        return await self._call(self._actor.upload.remote(path, data))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return await self._call(self._actor.download.remote(path, max_bytes))

    async def export_file(self, path: str, dest: Path, *, max_bytes: int) -> int:
        """Copy a workspace file here a chunk at a time: at most a few chunks in flight."""
        self.check_not_lost()
        generator = self._actor.export_chunks.remote(path, max_bytes)
        size = 0
        finished = False
        try:
            with dest.open("wb") as sink:
                async for ref in generator:
                    chunk: bytes = await self._call(ref)
                    await asyncio.to_thread(sink.write, chunk)
                    size += len(chunk)
            finished = True
        except SandboxError:
            finished = True
            raise
        except Exception as exc:
            finished = True
            await self.raise_as_sandbox_error(exc)
        finally:
            if not finished:
                _cancel(generator)
        return size

    async def import_file(self, path: str, source: Path) -> FileInfo:
        """Send a file of this machine into the workspace a chunk at a time."""
        token: str = await self._call(self._actor.import_open.remote())
        try:
            with source.open("rb") as reader:
                while chunk := await asyncio.to_thread(reader.read, FILE_CHUNK_BYTES):
                    await self._call(self._actor.import_write.remote(token, chunk))
            self._changes_sent += 1
            return await self._call(self._actor.import_commit.remote(token, path))
        except BaseException:
            if self._lost is None:
                with contextlib.suppress(Exception):  # sent, not awaited: the caller may be gone
                    self._actor.import_abort.remote(token)
            raise

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        return await self._call(self._actor.list_files.remote(path, recursive))

    async def remove_file(self, path: str) -> None:
        self._changes_sent += 1
        await self._call(self._actor.remove_file.remote(path))

    # --- processes (sandbox/backends/ray_cluster/remote_process.py) -----------------------

    async def start_process(self, request: ProcessRequest) -> ProcessHandle:
        from sandbox.backends.ray_cluster.remote_process import remote_start_process

        self._changes_sent += 1
        return await self._guard(remote_start_process(self._actor, request, self))

    async def run_command(self, request: ProcessRequest) -> CommandResult:
        from sandbox.backends.ray_cluster.remote_process import remote_run_command

        self._changes_sent += 1
        return await self._guard(remote_run_command(self._actor, request, self))

    async def get_process(self, pid: int) -> ProcessHandle:
        from sandbox.backends.ray_cluster.remote_process import remote_get_process

        return await self._guard(remote_get_process(self._actor, pid, self))

    async def processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        from sandbox.backends.ray_cluster.remote_process import remote_list_processes

        return await self._guard(remote_list_processes(self._actor, include_ended, self))

    def process(self, pid: int) -> Any:
        raise ProcessesUnsupported(
            "a ray sandbox's processes live on its node: use `await get_process(pid)`"
        )

    def list_processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        raise ProcessesUnsupported(
            "a ray sandbox's processes live on its node: use `await processes()`"
        )

    async def _guard(self, call: Awaitable[T]) -> T:
        """A call made by remote_process.py (which reports failures through
        `raise_as_sandbox_error`): none once lost."""
        try:
            self.check_not_lost()
        except SandboxError:
            with contextlib.suppress(Exception):
                cast(Any, call).close()  # the coroutine never runs
            raise
        return await call

    # --- whole machines (node_machines.py), where the node's backend saves them --------------

    async def suspend(self) -> str | None:
        """Pause the whole machine: saved and stopped on its node, its image carried to the
        shared store, its handle returned for `RayBackend.wake` on any node. None where its
        node cannot (its backend, or what the machine holds) or there is no shared store: the
        service then saves the kernel's state. If the image cannot be carried (a tree over its
        caps, the store full or out of reach), the machine runs on again on its node, as it
        was, and None too (said in the log); if it cannot even run on, the error."""
        if self._machines is None or not self.facts.whole_saves:
            return None
        token: str | None = await self._call(self._actor.suspend_here.remote(PAUSE_LAPSE_S))
        if token is None:
            return None
        handle = self._machines.handle_of(token)
        sending = self._actor.send_paused.remote(image_cap(self.spec))
        try:
            await receive_tree(
                sending,
                self._machines.path(handle),
                max_bytes=image_cap(self.spec),
                take=self._call,
            )
        except Exception as exc:
            _cancel(sending)  # before the wake: it would fence the woken machine again
            await self._call(self._actor.wake_here.remote())
            log.warning(
                "session actor %s: its machine could not be carried to the store (%s); it runs "
                "on, its kernel's state is saved instead",
                self._name,
                exc,
            )
            return None
        except BaseException:  # the caller left: woken all the same (shielded), then gone
            _cancel(sending)
            with contextlib.suppress(Exception):
                await asyncio.shield(self._call(self._actor.wake_here.remote()))
            raise
        try:
            await self._machines.mark_paused_from(handle, self._name)
        except OSError as exc:  # the store took the image but not this: it runs on, as above
            await self._machines.discard(handle)
            await self._call(self._actor.wake_here.remote())
            log.warning("session actor %s: its machine's image was not marked: %s", self._name, exc)
            return None
        try:
            await self._call(self._actor.paused_away.remote())
        except MachineWokeAgain as exc:  # woken on its node meanwhile (the lapse): runs on
            await self._machines.discard(handle)
            log.warning("session actor %s: %s", self._name, exc)
            return None
        except Exception as exc:  # the image is safe in the store: the pause holds, and the
            # release that follows ends the actor (its node's copy with it)
            log.warning("session actor %s did not hear its image is safe: %s", self._name, exc)
        return handle

    async def save_whole(self, into: Path, *, max_bytes: int) -> SavedState | None:
        """A snapshot of the whole machine, saved on its node (which runs on) and carried
        into `into`; None where its node cannot save it so."""
        if not self.facts.whole_saves:
            return None
        saved: tuple[str, SavedState] | None = await self._call(
            self._actor.save_whole_here.remote(max_bytes)
        )
        if saved is None:
            return None
        token, state = saved
        try:
            await receive_tree(
                self._actor.send_save.remote(token, max_bytes),
                into,
                max_bytes=max_bytes,
                take=self._call,
            )
        except TreeRefused as exc:  # over its caps once carried: as a save over them is
            raise StateTooLarge(f"the whole machine cannot be carried: {exc}") from None
        return state

    # --- what the service reads and relays --------------------------------------------------

    async def activity(self) -> tuple[float, int]:
        """(seconds since its last call ended, calls in flight), over every replica."""
        return await self._call(self._actor.idle_state.remote())

    async def touch(self) -> None:
        """Keep it alive: its idle time, counted by the actor for every replica, starts again."""
        await self._call(self._actor.touch.remote())

    async def fence_mark(self) -> tuple[int, int]:
        """Where a save starts: (the calls that may change its state the actor has taken from
        every replica, those this proxy sent)."""
        return await self._call(self._actor.changes.remote()), self._changes_sent

    async def fence(self, mark: tuple[int, int], why: str) -> bool:
        """After a save begun at `mark`: refuse every call from now on (`why` tells other
        replicas' callers) if no other replica changed its state since; False if one did."""
        taken, sent = mark
        expected = taken + (self._changes_sent - sent)
        return await self._call(self._actor.fence.remote(expected, why))

    async def unfence(self) -> None:
        await self._call(self._actor.unfence.remote())

    async def set_tool_manifest(self, manifest: bytes) -> None:
        await self._call(self._actor.set_tool_manifest.remote(manifest))

    async def tool_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        """Host-tool calls the kernel made, to answer (a long poll, node_tool_relay.py)."""
        return await self._call(self._actor.next_tool_calls.remote(max_wait_s))

    async def answer_tool_call(self, key: str, body: bytes) -> None:
        await self._call(self._actor.answer_tool_call.remote(key, body))

    async def open_egress(
        self, ceiling: NetworkPolicy, settings: EgressSettings, caps: SharedCaps
    ) -> bool:
        """Start the sandbox's egress proxy on its node (node_egress.py) under the service's
        `ceiling`, `settings` and shared `caps` (counted for the whole cluster:
        egress_counter.py); whether one runs (none: the sandbox has no way out)."""
        return await self._call(self._actor.open_egress.remote(ceiling, settings, caps))

    async def egress_records(self, max_wait_s: float) -> EgressBatch:
        """The proxy's records of connections ended since the last poll (a long poll)."""
        # Asked while the session closes too: the records of its last connections come then.
        ref = self._actor.next_egress_records.remote(max_wait_s)
        return await self._call(ref, while_closing=True)

    async def egress_report(self, most: int) -> EgressReport | None:
        """The proxy's totals and latest `most` records; None when the session has none."""
        return await self._call(self._actor.egress_report.remote(most))

    async def close(self) -> None:
        """Close the sandbox and end its actor (its slot goes back to its node): the actor has
        `CLOSE_WAIT_S` to close its sandbox, then it is killed whatever happened."""
        if self._closed:
            return
        self._closed = True
        failure: Exception | None = None
        try:
            if self._lost is None:
                await asyncio.wait_for(self._actor.close.remote(), CLOSE_WAIT_S)
        except RayActorError:
            pass  # the actor ends itself as it answers: that is the expected end
        except TimeoutError:
            log.warning("session actor %s did not close in %s s: killed", self._name, CLOSE_WAIT_S)
        except Exception as exc:
            failure = exc  # its sandbox failed to close: the actor is ended all the same
        finally:
            await kill_actor(self._actor)
        if failure is not None:
            await self.raise_as_sandbox_error(failure)


async def kill_actor(actor: ActorRef) -> None:
    """`ray.kill(no_restart=True)` off the event loop (a GCS round trip for a detached actor),
    waited for at most `KILL_WAIT_S`; best effort: it may be gone already."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.to_thread(ray.kill, actor, no_restart=True), KILL_WAIT_S)


def _cancel(ref: Any) -> None:
    """Cancel an actor call (or a streaming call) whose caller left; best effort: the actor,
    or this process's Ray, may be gone already."""
    with contextlib.suppress(Exception):
        ray.cancel(ref)
