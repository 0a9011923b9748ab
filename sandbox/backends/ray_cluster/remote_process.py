"""The replica's side of a process that runs in a session actor's sandbox on another node
(`node_processes.py` is the actor's side): the same `ProcessHandle` the service drives a
local process by.

Every call forwards to the actor and awaits its ref (never `ray.get` in the event loop). A
caller that leaves cancels the actor's call too: a command run to its end is then killed, a
stream followed stops (its listener goes), a wait stops waiting. Errors come back as the
sandbox layer's own: the actor's `SandboxError` as it was raised there (an unknown pid is the
same `ProcessNotFound` as on one machine), a dead actor as `SandboxLost`, one out of reach for
now as `BackendUnavailable` (actor_errors.py decides). The sandbox the process belongs to
(`RaySandbox`) is the `LossHook` of its calls: a loss found through a process is recorded on
the sandbox, with the same full reason, and every later call of either fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, Protocol, TypeVar

import ray

from code_interpreter_wire.errors import SandboxLost
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessInfo,
    ProcessRequest,
    TerminalSize,
)
from sandbox.backends.ray_cluster.actor_errors import (
    actor_id_of,
    is_actor_failure,
    sandbox_error_of,
)
from sandbox.backends.ray_cluster.node_processes import EVENTS_UNREAD
from sandbox.processes.handle import ProcessHandle
from sandbox.processes.managed import KILL_GRACE_S, ProcessEvent

T = TypeVar("T")
# A handle of a `SessionActor`. Ray types an actor's methods as reached by name only
# (`ActorHandle.__getattr__` is typed `Never`), so it is held as Any here.
ActorRef = Any


class LossHook(Protocol):
    """What a process's calls report failures to: its sandbox (`RaySandbox`)."""

    def check_not_lost(self) -> None:
        """Raise at once when the sandbox is known lost (or closed)."""
        ...

    async def raise_as_sandbox_error(self, exc: BaseException) -> NoReturn:
        """The failure as the sandbox layer's error; a loss is recorded for later calls."""
        ...


class BareActor:
    """The hook of calls made on an actor handle alone (no `RaySandbox` to record a loss
    on): the same errors, remembered here for this handle's later calls."""

    def __init__(self, actor: ActorRef) -> None:
        self._actor = actor
        self._lost: str | None = None

    def check_not_lost(self) -> None:
        if self._lost is not None:
            raise SandboxLost(self._lost)

    async def raise_as_sandbox_error(self, exc: BaseException) -> NoReturn:
        if self._lost is not None and is_actor_failure(exc):
            raise SandboxLost(self._lost) from None
        name = f"actor {actor_id_of(self._actor)}"
        error = await sandbox_error_of(exc, name, None, actor_id_of(self._actor))
        if isinstance(error, SandboxLost):
            self._lost = str(error)
        if error is exc:
            raise error
        raise error from None


class RemoteProcess:
    """A process of a sandbox held by a session actor. `info()` is as of when the handle was
    got (call `remote_get_process` again for a fresh one); everything else asks the actor."""

    def __init__(self, actor: ActorRef, info: ProcessInfo, hook: LossHook | None = None) -> None:
        self._actor = actor
        self._info = info
        self._hook = hook or BareActor(actor)

    @property
    def pid(self) -> int:
        return self._info.pid

    def info(self) -> ProcessInfo:
        return self._info

    def events(self, *, replay: bool = False) -> AsyncIterator[ProcessEvent]:
        """Its output from this call on: the actor starts following it now, not at the first
        read (`replay`: the most recent kept first), then its end. Closing the stream, or
        dropping it, read or not, stops the actor's generator (and so its listener)."""
        self._hook.check_not_lost()
        generator = self._actor.process_events.options(
            num_returns="streaming", _generator_backpressure_num_objects=EVENTS_UNREAD
        ).remote(self.pid, replay)
        return EventStream(generator, self._hook)

    async def wait(self) -> CommandResult:
        return await _call(self._hook, lambda: self._actor.wait_process.remote(self.pid))

    async def write_stdin(self, data: bytes) -> None:
        await _call(self._hook, lambda: self._actor.write_stdin.remote(self.pid, data))

    async def close_stdin(self) -> None:
        await _call(self._hook, lambda: self._actor.close_stdin.remote(self.pid))

    async def signal(self, signum: int) -> None:
        await _call(self._hook, lambda: self._actor.signal_process.remote(self.pid, signum))

    async def resize(self, size: TerminalSize) -> None:
        await _call(self._hook, lambda: self._actor.resize.remote(self.pid, size))

    async def kill(self, grace_s: float = KILL_GRACE_S) -> None:
        await _call(self._hook, lambda: self._actor.kill_process.remote(self.pid, grace_s))


async def remote_get_process(
    actor: ActorRef, pid: int, hook: LossHook | None = None
) -> ProcessHandle:
    """The process `pid` of the actor's sandbox; `ProcessNotFound` if it has none."""
    hook = hook or BareActor(actor)
    return RemoteProcess(actor, await _call(hook, lambda: actor.process_info.remote(pid)), hook)


async def remote_start_process(
    actor: ActorRef, request: ProcessRequest, hook: LossHook | None = None
) -> ProcessHandle:
    """Start a process in the actor's sandbox; it runs on after this call."""
    hook = hook or BareActor(actor)
    info = await _call(hook, lambda: actor.start_process.remote(request))
    return RemoteProcess(actor, info, hook)


async def remote_run_command(
    actor: ActorRef, request: ProcessRequest, hook: LossHook | None = None
) -> CommandResult:
    """Run a command to its end in the actor's sandbox; cancelling this kills it there."""
    return await _call(hook or BareActor(actor), lambda: actor.run_command.remote(request))


async def remote_list_processes(
    actor: ActorRef, include_ended: bool, hook: LossHook | None = None
) -> list[ProcessInfo]:
    return await _call(hook or BareActor(actor), lambda: actor.list_processes.remote(include_ended))


# ---------------------------------------------------------------------------------------------


async def _call(hook: LossHook, send: Callable[[], ray.ObjectRef[T]]) -> T:
    """The actor's answer (none sent once the sandbox is lost); a caller that leaves cancels
    the actor's call too."""
    hook.check_not_lost()
    ref = send()
    try:
        return await ref
    except asyncio.CancelledError:
        _cancel(ref)
        raise
    except Exception as exc:
        await hook.raise_as_sandbox_error(exc)


class EventStream:
    """The events a streaming call of `process_events` yields, until the process's end.

    The actor's generator starts when the call is made, not at the first read, and Ray runs a
    generator nobody reads to its end: so this object cancels it whenever it is left before
    the end: `aclose()`, a reader cancelled mid-read, or the object dropped unread (`__del__`).
    """

    def __init__(self, generator: Any, hook: LossHook) -> None:
        self._generator = generator
        self._hook = hook
        self._ended = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> ProcessEvent:
        if self._ended:
            raise StopAsyncIteration
        try:
            ref = await self._generator.__anext__()
            event: ProcessEvent = await ref
        except StopAsyncIteration:
            self._ended = True
            raise
        except asyncio.CancelledError:
            self._stop()
            raise
        except Exception as exc:
            self._ended = True  # the generator failed: nothing runs to cancel
            await self._hook.raise_as_sandbox_error(exc)
        if isinstance(event, ProcessEnd):
            self._ended = True  # the actor's generator ends after the end
        return event

    async def aclose(self) -> None:
        self._stop()

    def __del__(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if not self._ended:
            self._ended = True
            _cancel(self._generator)


def _cancel(ref: Any) -> None:
    """Cancel an actor call whose caller left; best effort: the actor, or this driver's Ray,
    may be gone already."""
    with contextlib.suppress(Exception):
        ray.cancel(ref)
