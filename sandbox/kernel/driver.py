"""The kernel driver: runs code in one stateful Jupyter kernel and never leaves its caller hanging.

It owns one kernel at a time (a "generation") and replaces it when it dies, when it will not stop
after an interrupt, or on request. Executions run one at a time, in the order they were asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from code_interpreter_wire.errors import SandboxClosed, SandboxError, SandboxStartError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import EventSink, Execution, ExecutionError, ExecutionStatus
from code_interpreter_wire.spec import SandboxSpec
from sandbox.host_channel import TOOL_ORIGIN_ENV
from sandbox.kernel.channels import OutputHandler, Watch, frame_limit_bytes
from sandbox.kernel.collector import OutputCollector, capped
from sandbox.kernel.connection import seal_kernel_dir
from sandbox.kernel.generation import (
    KernelGeneration,
    answers,
    dispose,
    launch_generation,
    send_execute,
    send_interrupt,
)
from sandbox.kernel.process import KernelLauncher
from sandbox.kernel.scopes import scope
from sandbox.kernel.wire import KernelMessage
from sandbox.languages import KERNEL_TRAITS

log = logging.getLogger(__name__)

# How long a kernel that may have died is given to answer before its code is sent: a dead one's
# death is seen within ~50 ms (Docker's event stream), a live one answers in ~1 ms.
PROBE_S = 2.0


@dataclass
class _Run:
    """The execution in progress, and what others have asked of it."""

    deadline: float
    msg_id: str = ""
    watch: Watch | None = None  # its output and end, as the iopub reader sees them
    reply: asyncio.Future[dict[str, Any]] | None = None  # the shell's execute_reply
    finished: bool = False  # the kernel replied and reported idle (or went quiet) for it
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    interrupted: bool = False  # an interrupt was sent (by the time limit or on request)
    cancelled: bool = False  # interrupted on request rather than by the time limit
    restart_requested: bool = False

    def wake(self) -> None:
        self.woken.set()


class KernelDriver:
    """Drives the kernel a `KernelLauncher` starts, over the ipc sockets in its directory."""

    def __init__(
        self,
        launcher: KernelLauncher,
        *,
        language: str = PYTHON,
        interrupt_grace_s: float = 3.0,
        output_limit_chars: int = 1_000_000,
        result_limit_bytes: int = 50 << 20,
        result_limit_count: int = 1000,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self._launcher = launcher
        self.language = language
        self._late_output = KERNEL_TRAITS[language].late_output
        self.interrupt_grace_s = interrupt_grace_s
        self.output_limit_chars = output_limit_chars
        self.result_limit_bytes = result_limit_bytes
        self.result_limit_count = result_limit_count
        self.startup_timeout_s = startup_timeout_s
        self._kernel: KernelGeneration | None = None
        self._generation = 0
        self._lock = asyncio.Lock()  # FIFO: queued executions run in the order they came
        self._run: _Run | None = None
        self._closed = False
        self._notice: str | None = None  # state was lost between executions: told to the next
        self._scope_open = False  # a per-call env/cwd is applied and must be undone
        self._scope_exit = ""  # the code that undoes it
        self._background: set[asyncio.Task[Any]] = set()
        # Kernels being started or stopped by whoever holds the lock: a close waits for them
        # (see `_kernel_work`), so nothing they make outlives the sandbox.
        self._kernel_work_done: set[asyncio.Future[None]] = set()
        # What processes beside the kernel did (see `watch_processes`), as last seen.
        self._process_activity: Callable[[], int | None] = lambda: 0
        self._activity_seen: int | None = 0
        # The key the kernel takes during the request being sent (`rekey`), that kernel, and
        # once sent, the request's id.
        self._key_after_send: tuple[KernelGeneration, bytes, str] | None = None

    @classmethod
    def for_spec(
        cls, launcher: KernelLauncher, spec: SandboxSpec, language: str = PYTHON
    ) -> KernelDriver:
        return cls(
            launcher,
            language=language,
            interrupt_grace_s=spec.interrupt_grace_s,
            output_limit_chars=spec.output_limit_chars,
            result_limit_bytes=spec.result_limit_bytes,
            result_limit_count=spec.result_limit_count,
        )

    # ----------------------------------------------------------------------------------------
    # Life cycle

    async def start(self) -> None:
        """Start the first kernel and wait until it answers."""
        async with self._lock:
            await self._start_kernel()

    async def close(self) -> None:
        """Kill the kernel for good. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._run is not None:
            self._run.wake()
        try:
            # A task cut short while it replaced the kernel still finishes removing what it had
            # started (`dispose`, and a launcher's cancelled launch, run to their end); a start
            # or stop by an execution (a restart after a time limit, a kernel a command killed)
            # ends soon, seeing the sandbox closed. Both are waited for, so nothing of theirs
            # outlives the sandbox; as long as there are any (a task cancelled meanwhile may
            # make another).
            while self._background or self._kernel_work_done:
                background = list(self._background)
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, *self._kernel_work_done, return_exceptions=True)
        finally:  # even if this close is itself cancelled: the kernel must not outlive it
            await self._stop_kernel()

    async def rekey(self, code: str, key: str, *, timeout_s: float = 30.0) -> None:
        """Give the running kernel a new signing key (one restored from an image other
        sandboxes are restored from too must not share its key with them). `code` sets it, as
        its last act, and whatever else such a kernel must not share (its random streams); it
        runs silently, signed with the old key, and from its sending on the new key signs
        ours while either is good for the kernel's answers to it. SandboxError if it failed:
        the kernel then keeps its old key, and so do we."""
        async with self._lock:
            kernel = self._kernel
            if self._closed or kernel is None:
                raise SandboxClosed("the sandbox is closed")
            session, channels = kernel.client.session, kernel.channels
            old_key = session.key
            channels.previous_auth = session.auth
            self._key_after_send = (kernel, key.encode(), "")
            try:
                done = await self._execute_locked(code, timeout_s, None, None, None, silent=True)
                msg_id = self._key_after_send[2]
            finally:
                self._key_after_send = None
                channels.previous_auth = None
                self._run = None
            # The code may have run and not changed the key (what it calls can be shadowed by
            # the session's own code): its answer, signed with the old key, says so.
            kept_old = msg_id in channels.replied_with_previous_key
            channels.replied_with_previous_key.clear()
            if not done.ok or kept_old:
                session.key = old_key
                why = "it kept its old key" if kept_old else done.error or done.status.value
                raise SandboxError(f"the kernel's key could not be changed: {why}")

    @contextlib.asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Inside, no code runs in the kernel (its sandbox is saved whole meanwhile)."""
        async with self._lock:
            yield

    @property
    def is_busy(self) -> bool:
        return self._lock.locked()

    def watch_processes(self, activity: Callable[[], int | None]) -> None:
        """Processes beside the kernel can kill it (`kill -9 -1`), and the next call can come
        before its death is seen. `activity()` changes whenever one starts, and is None while
        any runs: then an execution first makes sure the kernel answers (~1 ms), and a dead one
        is replaced before the code is sent to it."""
        self._process_activity = activity

    def _may_have_died(self) -> bool:
        """Whether the kernel may be dead though its watcher has not said so: its output
        connection dropped, or processes that could have killed it ran since the last call."""
        kernel = self._kernel
        assert kernel is not None
        if kernel.exited.done() or not kernel.channels.iopub_seen.is_set():
            return True
        activity = self._process_activity()
        changed = activity is None or activity != self._activity_seen
        self._activity_seen = activity
        return changed

    @contextlib.asynccontextmanager
    async def _kernel_work(self) -> AsyncIterator[None]:
        """Inside, a kernel is started or stopped: `close` waits until it is over."""
        done = asyncio.get_running_loop().create_future()
        self._kernel_work_done.add(done)
        try:
            yield
        finally:
            self._kernel_work_done.discard(done)
            done.set_result(None)

    async def _start_kernel(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed")
        async with self._kernel_work():
            await self._start_kernel_now()

    async def _start_kernel_now(self) -> None:
        self._generation += 1
        kernel = await launch_generation(
            self._launcher,
            self._generation,
            frame_limit=frame_limit_bytes(self.result_limit_bytes, self.output_limit_chars),
            text_limit=self.output_limit_chars,
        )
        try:
            await self._wait_ready(kernel)
            if self._closed:
                raise SandboxClosed("the sandbox was closed while its kernel started")
            seal_kernel_dir(self._launcher.kernel_dir)
        except BaseException:
            await dispose(kernel)
            raise
        self._kernel = kernel
        kernel.exited.add_done_callback(lambda _: self._on_exit(kernel))

    async def _wait_ready(self, kernel: KernelGeneration) -> None:
        """Wait until a kernel that is starting answers (see `_answers`)."""
        if not await self._answers(kernel):
            output = kernel.process.diagnostics().strip()
            raise SandboxStartError(
                f"the kernel {kernel.exited.result().reason} on start-up"
                + (f"; its last output:\n{output}" if output else "")
            )

    async def _answers(self, kernel: KernelGeneration) -> bool:
        """Whether a kernel answers (`generation.answers`); False once found dead instead."""
        return await answers(kernel, self.startup_timeout_s, lambda: self._closed)

    async def _found_dead(self, kernel: KernelGeneration, within_s: float) -> bool:
        """Whether the kernel turns out dead when asked to answer (kernel_info, ~1 ms). One
        alive but slow to answer (stopped, or starved by its own threads) is left to the run's
        time limit, as before, once `within_s` (at most PROBE_S) has passed."""
        msg_id = kernel.client.kernel_info()
        kernel.channels.sent_on_shell()
        either: set[asyncio.Future[Any]] = {kernel.channels.reply_to(msg_id), kernel.exited}
        wait_s = min(PROBE_S, within_s)
        await asyncio.wait(either, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        kernel.channels.forget_reply(msg_id)
        return kernel.exited.done()

    async def _stop_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            async with self._kernel_work():
                await dispose(kernel)

    async def _replace_kernel(self) -> None:
        """Kill the current kernel and start a fresh one (the lock is held)."""
        await self._stop_kernel()
        await self._start_kernel()

    def _on_exit(self, kernel: KernelGeneration) -> None:
        """A kernel died. If nobody is executing, replace it now so the next call is quick."""
        if self._closed or kernel is not self._kernel or kernel.exited.cancelled():
            return
        if self._run is not None:
            return  # the running execution sees it and recovers
        task = asyncio.ensure_future(self._recover_idle(kernel))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _recover_idle(self, kernel: KernelGeneration) -> None:
        async with self._lock:
            if self._closed or kernel is not self._kernel:
                return
            await self._replace_dead(kernel)

    async def _replace_dead(self, kernel: KernelGeneration) -> None:
        """Replace a kernel that died between executions (the lock is held)."""
        death = kernel.exited.result()
        log.warning("kernel died between executions (it %s); restarting", death.reason)
        self._notice = (
            f"Between executions the kernel {death.reason}; it was restarted: variables and "
            "imports from earlier calls are gone; files in the workspace are kept."
        )
        self._scope_open = False
        try:
            await self._replace_kernel()
        except Exception:
            if not self._closed:
                log.exception("could not restart the kernel")
            self._kernel = None

    # ----------------------------------------------------------------------------------------
    # Control

    async def interrupt(self) -> bool:
        """Stop the running execution: it ends as `cancelled`. Returns False if none was running.

        An execution that ignores the interrupt is ended by a kernel restart after the grace
        period, as with a timeout.
        """
        run, kernel = self._run, self._kernel
        if run is None or kernel is None:
            return False
        if run.reply is not None and run.reply.done():
            return False  # the code is over (its last output is on the way): nothing to stop
        run.cancelled = True
        if not run.interrupted:
            run.interrupted = True
            self._send_interrupt(kernel)
            run.deadline = time.monotonic() + self.interrupt_grace_s
        run.wake()
        return True

    async def restart(self) -> None:
        """Replace the kernel with a fresh one; a running execution ends as `cancelled`."""
        if self._closed:
            raise SandboxClosed("the sandbox is closed")
        run = self._run
        if run is not None:
            run.cancelled = True
            run.restart_requested = True
            run.wake()
        generation = self._generation
        async with self._lock:
            if self._generation == generation or self._kernel is None:
                await self._replace_kernel()
            self._notice = None
            self._scope_open = False

    def _send_interrupt(self, kernel: KernelGeneration) -> None:
        send_interrupt(kernel, self.language, self._launcher)

    # ----------------------------------------------------------------------------------------
    # Execution

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        silent: bool = False,
    ) -> Execution:
        """Run `code`; return everything it produced. Never raises for what the code does.

        `silent` runs housekeeping: no history, no execution count, no result value.
        """
        if self._closed:
            raise SandboxClosed("the sandbox is closed")
        await self._lock.acquire()
        handed_off = False
        try:
            if self._closed:
                raise SandboxClosed("the sandbox is closed")
            if self._kernel is None:  # a previous restart failed: try again now
                await self._start_kernel()
            return await self._execute_locked(code, timeout_s, env, cwd, on_event, silent)
        except asyncio.CancelledError:
            # The caller went away mid-run. Stop the code so the session is not left busy, and
            # keep the lock until the kernel is idle again, so queued calls start on a quiet kernel.
            if self._run is not None:
                handed_off = True
                task = asyncio.ensure_future(self._settle_after_cancel(self._run))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise
        finally:
            if not handed_off:
                self._run = None
                self._lock.release()

    async def _settle_after_cancel(self, run: _Run) -> None:
        """The caller of `run` went away: stop its code, undo its scope, then free the lock."""
        try:
            kernel = self._kernel
            if kernel is None:
                return
            if not run.finished and run.watch is not None and run.reply is not None:
                try:
                    if not run.reply.done():  # the code still runs: stop it
                        self._send_interrupt(kernel)
                        await asyncio.wait_for(asyncio.shield(run.reply), self.interrupt_grace_s)
                    # Stopped: its last output is drained under a bound of the reader's own.
                    await kernel.channels.until_finished(run.watch, run.reply, self._late_output)
                except TimeoutError:
                    if self._closed:  # the close stops the kernel: nothing to replace
                        return
                    self._notice = (
                        "An execution whose caller went away did not stop when interrupted, so "
                        "the kernel was restarted: variables and imports from earlier calls are "
                        "gone; files in the workspace are kept."
                    )
                    self._scope_open = False
                    await self._replace_kernel()
                    return
            if self._scope_open:
                await self._close_scope()
        except Exception:
            log.exception("could not settle the kernel after a cancelled execution")
        finally:
            if run is self._run:
                self._run = None
            self._lock.release()

    async def _close_scope(self) -> None:
        self._scope_open = False
        await self._run_request(self._scope_exit, 10.0, OutputCollector(1000, None), True)

    async def _execute_locked(
        self,
        code: str,
        timeout_s: float,
        env: dict[str, str] | None,
        cwd: str | None,
        on_event: EventSink | None,
        silent: bool = False,
    ) -> Execution:
        started = time.monotonic()
        collector = OutputCollector(
            self.output_limit_chars,
            on_event,
            result_limit_bytes=self.result_limit_bytes,
            result_limit_count=self.result_limit_count,
        )
        assert self._kernel is not None
        kernel = self._kernel
        # The probe's wait counts against the run's time limit (a new kernel's start does not).
        # Only processes of the table make it look: a kill from outside them (by the host) is
        # left to the death watcher.
        if self._may_have_died() and await self._found_dead(kernel, timeout_s):
            # Dead since the last call, before its watcher acted (a command's `kill -9 -1`
            # just now): this call runs on a new kernel rather than failing on the dead one.
            await self._replace_dead(kernel)
            if self._kernel is None:
                raise SandboxStartError("the kernel died and could not be restarted")
        probed_s = 0.0 if self._kernel is not kernel else time.monotonic() - started
        notice, self._notice = self._notice, None
        state_lost = notice is not None

        env, origin = _origin_apart(self.language, env)
        scoped = bool(env) or cwd is not None
        if scoped:
            applied = scope(self.language, dict(env or {}), cwd)
            self._scope_exit = applied.exit
            status, fields = await self._run_request(applied.enter, timeout_s, collector, True)
            if status is not ExecutionStatus.OK:
                return collector.build(
                    status=status, duration_s=time.monotonic() - started, notice=notice, **fields
                )
            self._scope_open = True
        status, fields = await self._run_request(
            code, timeout_s, collector, silent=silent, origin=origin, spent_s=probed_s
        )
        if self._scope_open and not fields.get("state_lost"):
            await self._close_scope()
        fields["state_lost"] = state_lost or fields.get("state_lost", False)
        return collector.build(
            status=status, duration_s=time.monotonic() - started, notice=notice, **fields
        )

    async def _run_request(
        self,
        code: str,
        timeout_s: float,
        collector: OutputCollector,
        silent: bool,
        origin: str | None = None,
        spent_s: float = 0.0,
    ) -> tuple[ExecutionStatus, dict[str, Any]]:
        """Send one execute_request and follow it to the end, whatever that end is. `origin`
        goes in the request's metadata, where the kernel's start-up file reads it; `spent_s`
        of the time limit went before the request was sent."""
        kernel = self._kernel
        assert kernel is not None
        # Output was reset (a message over the cap, or the kernel died): wait until it is live.
        if not kernel.channels.iopub_seen.is_set() and not await self._answers(kernel):
            death = kernel.exited.result()
            why = f"the kernel {death.reason}"
            return await self._after_restart(
                collector, ExecutionStatus.KERNEL_DIED, why, name="KernelDied"
            )
        run = self._run = _Run(deadline=time.monotonic() + max(0.0, timeout_s - spent_s))
        msg_id = run.msg_id = send_execute(kernel, code, silent, origin)
        pending = self._key_after_send
        if pending is not None and pending[1] and pending[0] is kernel:
            kernel.client.session.key = pending[1]  # what we send from now on
            self._key_after_send = (kernel, b"", msg_id)
        # Registered before any await: nothing of this request can arrive before them.
        take = _without_values(collector.take) if silent else collector.take
        watch = run.watch = kernel.channels.follow(msg_id, take)
        reply = run.reply = kernel.channels.reply_to(msg_id)
        finished = asyncio.ensure_future(
            kernel.channels.until_finished(watch, reply, self._late_output)
        )
        try:
            while True:
                if self._closed:
                    raise SandboxClosed("the sandbox was closed during the execution")
                if run.restart_requested:
                    return await self._after_restart(
                        collector, ExecutionStatus.CANCELLED, "the kernel was restarted on request"
                    )
                woken = asyncio.ensure_future(run.woken.wait())
                # Once the kernel has replied, the code is over: no time limit can apply any
                # more (the wait for its last output is itself bounded).
                timeout = None if reply.done() else max(0.0, run.deadline - time.monotonic())
                waiting: set[asyncio.Future[Any]] = {finished, kernel.exited, woken}
                try:
                    done, _ = await asyncio.wait(
                        waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:  # also when this call is cancelled: no waiter is left pending
                    woken.cancel()
                run.woken.clear()
                if finished in done:
                    run.finished = True
                    break
                if kernel.exited in done:
                    death = kernel.exited.result()
                    return await self._after_restart(
                        collector,
                        ExecutionStatus.KERNEL_DIED,
                        f"the kernel {death.reason}",
                        name="KernelDied",
                    )
                if time.monotonic() >= run.deadline and not reply.done():
                    if not run.interrupted:
                        run.interrupted = True
                        self._send_interrupt(kernel)
                        run.deadline = time.monotonic() + self.interrupt_grace_s
                        continue
                    status = ExecutionStatus.CANCELLED if run.cancelled else ExecutionStatus.TIMEOUT
                    why = (
                        "the execution was interrupted on request"
                        if run.cancelled
                        else f"the execution ran past its {timeout_s:g} s time limit"
                    )
                    return await self._after_restart(
                        collector,
                        status,
                        f"{why} and did not stop within {self.interrupt_grace_s:g} s of the "
                        "interrupt",
                        name="ExecutionTimeout"
                        if status is ExecutionStatus.TIMEOUT
                        else "Cancelled",
                    )
        finally:
            finished.cancel()
            watch.on_output = None  # what still comes for this request is nobody's
            collector.malformed_messages += watch.malformed
            collector.end_unconfirmed |= watch.end_unconfirmed
            watch.malformed = 0
        content = reply.result()
        count = content.get("execution_count")
        if collector.execution_count is None and not silent and isinstance(count, int):
            collector.execution_count = count
        if run.interrupted:
            status = ExecutionStatus.CANCELLED if run.cancelled else ExecutionStatus.TIMEOUT
            kernel_error = collector.error
            message = (
                "The execution was interrupted on request"
                if run.cancelled
                else f"The execution ran past its {timeout_s:g} s time limit and was interrupted"
            )
            await collector.emit_error(
                ExecutionError(
                    name="Cancelled" if run.cancelled else "ExecutionTimeout",
                    value=f"{message}; the kernel's state is kept.",
                    traceback=kernel_error.traceback if kernel_error else "",
                )
            )
            return status, {}
        if content.get("status") == "ok" and collector.error is None:
            return ExecutionStatus.OK, {}
        if collector.error is None:  # its error message was lost or malformed: use the reply's
            name, value = content.get("ename"), content.get("evalue")
            await collector.emit_error(
                ExecutionError(
                    name=capped(name if isinstance(name, str) else "Error", 1000, "the name"),
                    value=capped(
                        value if isinstance(value, str) else "the kernel reported an error",
                        self.output_limit_chars,
                        "the error value",
                    ),
                )
            )
        return ExecutionStatus.ERROR, {}

    async def _after_restart(
        self,
        collector: OutputCollector,
        status: ExecutionStatus,
        why: str,
        name: str = "Cancelled",
    ) -> tuple[ExecutionStatus, dict[str, Any]]:
        """Replace the kernel after a run it could not finish, and say so in the result."""
        self._scope_open = False
        try:
            await self._replace_kernel()
            after = "it was restarted"
        except Exception as exc:  # the next execute tries again
            if not self._closed:
                log.exception("kernel restart failed")
            self._kernel = None
            after = f"restarting it failed ({exc}); the next call tries again"
        await collector.emit_error(
            ExecutionError(
                name=name,
                value=f"{why[0].upper()}{why[1:]}, so {after}: variables and imports are lost "
                "(files in the workspace are kept).",
            )
        )
        return status, {"state_lost": True}


def _origin_apart(
    language: str, env: dict[str, str] | None
) -> tuple[dict[str, str] | None, str | None]:
    """A Python execution's tool origin travels in its request's metadata, not as a variable
    (which would cost two more requests: setting it and putting it back); every other
    language's kernel takes it as a per-call variable, which its child processes inherit."""
    if language != PYTHON or not env or TOOL_ORIGIN_ENV not in env:
        return env, None
    rest = dict(env)
    return rest, rest.pop(TOOL_ORIGIN_ENV)


def _without_values(take: OutputHandler) -> OutputHandler:
    """Housekeeping code's outputs without its values: kernels that ignore `silent` (jjava,
    Deno) still show the value of an expression, which is no result of the caller's."""

    async def on_output(msg: KernelMessage) -> None:
        if msg.msg_type not in ("execute_result", "display_data"):
            await take(msg)

    return on_output
