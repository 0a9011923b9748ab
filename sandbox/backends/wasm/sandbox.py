"""One wasm sandbox: a Deno process whose worker runs Pyodide (host.mjs, worker.mjs,
inside_pyodide.py), reached over a Unix socket in the sandbox's own directory.

The wall is Deno's permissions: the process may read Pyodide's files, its own scripts and its
socket, and nothing else (no network, environment, processes or other files), and the worker
running the session's Python may read only Pyodide's files. Everything that comes over the
socket is treated as the sandbox's word: frames are capped, each message's shape checked, its
outputs kept within the spec's limits (sandbox/kernel/collector.py).

A time limit interrupts the code (Pyodide's interrupt buffer); code that does not come back
within the spec's `interrupt_grace_s` (stuck outside the interpreter) costs the worker: a fresh one
replaces it, and the session's variables are lost (said on the execution).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import resource
import shutil
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from code_interpreter_wire.errors import (
    FileMissing,
    FileTooLarge,
    InvalidPath,
    LanguageUnavailable,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import (
    EventSink,
    Execution,
    ExecutionError,
    ExecutionStatus,
    FileInfo,
)
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Sandbox
from sandbox.backends.wasm.messages import (
    OFF_LOOP_BYTES,
    Pending,
    file_info,
    relative_to_workspace,
)
from sandbox.backends.wasm.tool_calls import WasmToolCalls
from sandbox.cgroups import SandboxCgroup
from sandbox.frames import FrameRefused, read_frame, write_frame
from sandbox.kernel.collector import OutputCollector
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.kernel.wire import Malformed
from sandbox.run_to_end import finish_even_if_cancelled
from sandbox.workspace_paths import clean_path

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
DRIVER = (HERE / "inside_pyodide.py").read_text()
MAX_FRAME = 64 << 20  # either way; past it from the sandbox, it is ended
START_S = 60.0  # Pyodide's cold start is 2-5 s; a loaded machine may take much longer
DENO_RESERVE_MB = 2048  # writable memory Deno and Pyodide reserve of their own (1.3 GiB fresh)
MAX_FILE = 32 << 20  # a file moved in or out, whole in one message (its base64, in memory)
CALL_S = 30.0
# How every Deno of the backend runs: nothing asked of a person, no configuration or lock file,
# nothing fetched, no compiled code kept on disk. What it may touch is each one's own flags.
DENO_RUN = (
    "run",
    "--no-prompt",
    "--no-config",
    "--no-lock",
    "--no-remote",
    "--no-npm",
    "--no-code-cache",
)
GROUP_RESERVE_MB = 1024  # resident memory of Deno's own, beside the session's, in its cgroup
GROUP_THREADS = 128  # Deno's threads (V8's, its runtime's, the worker's), whatever `pids` says
FRAME_S = 60.0  # a frame begun (up to MAX_FRAME) must arrive whole within this


class WasmSandbox(Sandbox):
    backend = "wasm"

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        root: Path,
        pyodide: Path,
        deno: str,
        wheels: Path | None = None,
        snapshot: Path | None = None,
        group: SandboxCgroup | None = None,
    ):
        self.id = sandbox_id
        self._wheels = wheels  # pure-Python wheels it may install: read-only to it
        self._snapshot = snapshot  # the memory snapshot it starts from (read-only), if any
        self._group = group  # its CPU quota, memory and threads (as root on cgroup v1), if any
        self.spec = spec
        self._root = root
        self._pyodide = pyodide
        self._deno = deno
        self._env: dict[str, str] = dict(spec.env)
        self._process: asyncio.subprocess.Process | None = None
        self._tail: StdioTail | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        self._running = asyncio.Lock()
        self._writing = asyncio.Lock()  # frames to the process, one whole after another
        self._run_id: int | None = None  # the run outstanding (an interrupt is for it alone)
        self._stopping: set[asyncio.Task[None]] = set()
        self._handed = False  # the running lock passed to a left run's stopping
        self._generation = 0  # of the worker: each start a new one
        self._closed = False
        self._lost: str | None = None
        self._tools = WasmToolCalls(self._send)

    # --- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start Deno and its worker and wait until Pyodide answers (or SandboxStartError)."""
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        path = self._root / "s"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            listener.listen(1)
            listener.setblocking(False)
            spawning = asyncio.ensure_future(
                asyncio.create_subprocess_exec(
                    *self._command(path),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    cwd=self._root,
                    env=self._process_env(),
                    start_new_session=True,
                )
            )
            try:  # known even if cancelled meanwhile, so that the close below ends it
                self._process = await finish_even_if_cancelled(spawning)
            except asyncio.CancelledError:
                if spawning.done() and not spawning.cancelled() and not spawning.exception():
                    self._process = spawning.result()
                raise
            assert self._process.stdout is not None
            self._tail = StdioTail(self._process.stdout)
            self._hold_to_memory(self._process.pid)
            if self._group is not None:
                await asyncio.to_thread(self._join_group, self._group, self._process.pid)
            conn = await self._accept(listener)
            reader, self._writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 16)
            self._reader_task = asyncio.ensure_future(self._read(reader))
            await self._start_worker()
            if self._group is not None:  # the session's code runs from now on: its quota too
                await asyncio.to_thread(self._group.set_cpu_quota, self.spec.limits.cpus)
            if self._closed:
                raise SandboxClosed("the sandbox was closed while it started")
        except BaseException as exc:
            try:
                reason = await self._startup_failure(exc)
            finally:  # whole, even if cancelled again (meanwhile, or at any step of it)
                await finish_even_if_cancelled(self.close())
            if self._group is not None:  # closed meanwhile (a restart's start): its group too
                await asyncio.to_thread(self._group.remove)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise SandboxStartError(reason) from None
        finally:
            listener.close()

    def _hold_to_memory(self, pid: int) -> None:
        """The process's writable memory, whatever allocates it (the interpreter's, Deno's own,
        buffers made through `js`): at most the session's memory and what Deno itself reserves
        (`DENO_RESERVE_MB`); past it, an allocation fails (or Deno ends, and the next execution
        says so). Set before the sandbox's code can run: it runs only once the worker is told
        to start."""
        limit = (self.spec.limits.memory_mb + DENO_RESERVE_MB) << 20
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.prlimit(pid, resource.RLIMIT_DATA, (limit, limit))

    def _join_group(self, group: SandboxCgroup, pid: int) -> None:
        """The process (every thread of it) into the sandbox's groups, before its worker is
        told to start: resident memory and threads with room for Deno's own
        (`GROUP_RESERVE_MB`, `GROUP_THREADS`); the spec's CPU quota once Pyodide has started
        (its start is the service's work, not the session's, and a third faster unthrottled)."""
        limits = self.spec.limits.model_copy(
            update={
                "memory_mb": self.spec.limits.memory_mb + GROUP_RESERVE_MB,
                "pids": max(self.spec.limits.pids, GROUP_THREADS),
                "cpus": os.cpu_count() or 1,  # Pyodide's start (ours): the spec's once it runs
            }
        )
        group.create(limits)
        for directory in group.dirs:
            (directory / "cgroup.procs").write_text(str(pid))

    async def _accept(self, listener: socket.socket) -> socket.socket:
        """The process's connection, or SandboxError as soon as it ends without one."""
        assert self._process is not None
        loop = asyncio.get_running_loop()
        accepting = asyncio.ensure_future(loop.sock_accept(listener))
        ended = asyncio.ensure_future(self._process.wait())
        try:
            async with asyncio.timeout(START_S):
                await asyncio.wait({accepting, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (accepting, ended):
                task.cancel()
        if not accepting.done() or accepting.cancelled():
            raise SandboxError(f"Deno ended (exit code {self._process.returncode})")
        conn, _ = accepting.result()
        return conn

    def _command(self, path: Path) -> list[str]:
        paths = [str(p) for p in (self._pyodide, HERE, path, self._wheels, self._snapshot) if p]
        if any("," in p for p in paths):
            raise SandboxError(f"Deno's permissions cannot name a path with a comma: {paths}")
        readable = ",".join(paths)
        heap_mb = self._heap_mb()
        return [
            self._deno,
            *DENO_RUN,
            "--unstable-worker-options",
            f"--allow-read={readable}",
            f"--allow-write={path}",
            f"--allow-net=unix:{path}",  # its socket, and no other address
            f"--v8-flags=--max-old-space-size={heap_mb}",
            str(HERE / "host.mjs"),
            str(path),
            str(self._pyodide),
            str(self._wheels or ""),
            str(self._snapshot or ""),
        ]

    def _process_env(self) -> dict[str, str]:
        """Deno's own environment: nothing of the service's (the sandbox cannot read it anyway:
        no env permission), and its caches in the sandbox's directory."""
        return {"DENO_DIR": str(self._no_dir()), "NO_COLOR": "1", "HOME": str(self._root)}

    def _no_dir(self) -> Path:
        """Where Deno keeps its caches, which its permissions do not cover (the sandbox could
        fill them by importing modules, or through the Cache API): a path under a plain file,
        which no directory can be made at, so nothing is written."""
        blocker = self._root / "no-cache"
        blocker.touch(mode=0o400, exist_ok=True)
        return blocker / "deno"

    async def _start_worker(self) -> None:
        """A fresh worker (host.mjs ends the one before, and what was asked of it), answering
        within START_S."""
        self._generation += 1
        self._tools.replaced(self._generation)
        self._fail_calls(SandboxError("the wasm worker was replaced while it was asked"))
        self._ready = ready = asyncio.get_running_loop().create_future()
        await self._send(self._init_message())
        if self._lost is not None:
            self._fail_ready(SandboxError(self._lost))
        try:
            async with asyncio.timeout(START_S):
                await asyncio.shield(ready)
        except TimeoutError:
            raise SandboxError(f"the wasm worker did not start within {START_S:g} s") from None

    def _fail_ready(self, error: SandboxError) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # read: a start that gave up leaves no warning

    def _init_message(self) -> dict[str, Any]:
        """A fresh worker: the driver, and the memory its interpreter may grow to (the spec's
        memory less what Deno's own heap may take)."""
        memory = (self.spec.limits.memory_mb - self._heap_mb()) << 20
        return {
            "op": "init",
            "driver": DRIVER,
            "memoryBytes": max(memory, 48 << 20),
            "generation": self._generation,
            "tools": self._tools.files(),
        }

    def _heap_mb(self) -> int:
        return max(64, self.spec.limits.memory_mb // 4)

    async def _startup_failure(self, exc: BaseException) -> str:
        if self._tail is not None:
            await self._tail.settle(0.5)
        said = self._tail.text().strip()[-2000:] if self._tail is not None else ""
        what = "did not start in time" if isinstance(exc, TimeoutError) else f"failed: {exc}"
        return f"the wasm sandbox (Deno, Pyodide) {what}" + (f"; it said: {said}" if said else "")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(SandboxClosed("the sandbox was closed"))
        self._fail_ready(SandboxClosed("the sandbox was closed"))
        if self._writer is not None:
            self._writer.close()
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 10)
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
        await self._tools.queue.close()  # after the reader: no call comes in after it
        if self._tail is not None:
            self._tail.stop()
        if self._group is not None:
            await asyncio.to_thread(self._group.remove)
        await asyncio.to_thread(shutil.rmtree, self._root, True)

    @property
    def is_busy(self) -> bool:
        return self._running.locked()

    # --- the socket -------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        if self._writer is None or self._lost is not None:
            raise SandboxError(self._lost or "the wasm sandbox is not running")
        body = json.dumps(message).encode()
        if len(body) > MAX_FRAME:
            raise SandboxError(f"a message of {len(body)} bytes is over the sandbox's frame cap")
        try:
            await write_frame(self._writer, self._writing, body)
        except OSError as exc:
            raise SandboxError(f"the wasm sandbox's connection failed: {exc}") from None

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Take frames until the process ends; a frame over the cap, cut short or not JSON
        ends it."""
        why = "the wasm sandbox's process ended"
        try:
            while True:
                try:
                    frame = await read_frame(reader, max_bytes=MAX_FRAME, timeout_s=FRAME_S)
                except FrameRefused as exc:
                    why = f"the wasm sandbox sent {exc}"
                    break
                if frame is None:
                    break
                try:
                    if len(frame) > OFF_LOOP_BYTES:
                        message = await asyncio.to_thread(json.loads, frame)
                    else:
                        message = json.loads(frame)
                    await self._take(message)
                except (ValueError, RecursionError, Malformed) as exc:
                    why = f"the wasm sandbox sent something unreadable: {exc}"
                    break
                except Exception:  # a caller's event sink that failed, say: this frame only
                    log.exception("wasm sandbox %s: a message could not be handled", self.id)
        except ConnectionError:
            pass
        self._lost = why
        self._fail_ready(SandboxError(why))
        self._fail_all(SandboxError(why))

    async def _take(self, message: Any) -> None:
        if not isinstance(message, dict):
            raise Malformed("a frame that is not an object")
        kind, body = message.get("type"), message.get("body")
        if message.get("generation") not in (None, self._generation):
            return  # of a worker replaced since
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
            return
        if kind == "tool" and isinstance(body, str):
            await self._tools.take(body, self._generation)
            return
        if kind == "snapshot_failed":
            log.warning("wasm sandbox %s started cold: its snapshot failed: %s", self.id, body)
            if self._snapshot is not None:  # taken again by the next sandbox's start
                with contextlib.suppress(OSError):
                    self._snapshot.unlink()
            return
        if kind == "worker_error":
            error = SandboxError(f"the wasm worker failed: {str(message.get('message'))[:2000]}")
            self._fail_ready(error)
            self._fail_all(error)
            return
        pending = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if pending is None:
            return  # late (after a time limit), or not ours: dropped
        if kind == "oversize":  # host.mjs would not carry it
            pending.oversize(message.get("size"), bool(message.get("output")))
            return
        if isinstance(body, str):
            await pending.take(str(kind), body)

    def _fail_all(self, error: SandboxError) -> None:
        for pending in list(self._pending.values()):
            pending.fail(error)

    def _fail_calls(self, error: SandboxError) -> None:
        for pending in list(self._pending.values()):
            if pending.collector is None:
                pending.fail(error)

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
        if language != PYTHON:
            raise LanguageUnavailable(f"the wasm backend runs Python only (asked: {language})")
        where = "/".join(
            clean_path(relative_to_workspace(cwd or self.spec.workdir), allow_root=True)
        )
        await self._running.acquire()
        try:
            return await self._execute(code, timeout_s, env, where, on_event)
        finally:
            if self._handed:  # released by the left run's stopping, once it is stopped
                self._handed = False
            else:
                self._running.release()

    async def _execute(
        self,
        code: str,
        timeout_s: float | None,
        env: dict[str, str] | None,
        cwd: str,
        on_event: EventSink | None,
    ) -> Execution:
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        limit = timeout_s if timeout_s is not None else self.spec.default_timeout_s
        collector = OutputCollector(self.spec.output_limit_chars, on_event)
        pending = Pending(collector)
        run_id = next(self._ids)
        self._pending[run_id] = pending
        self._run_id = run_id
        started, clock = datetime.now(UTC), time.monotonic()
        status, state_lost, notice = ExecutionStatus.OK, False, None
        try:
            environment = {**self._env, **(env or {})}
            message = {"op": "run", "id": run_id, "code": code, "env": environment, "cwd": cwd}
            await self._send(message)
            try:
                async with asyncio.timeout(limit):
                    outcome = await asyncio.shield(pending.done)
            except TimeoutError:
                status = ExecutionStatus.TIMEOUT
                outcome, state_lost = await self._interrupt(run_id, pending)
                await collector.emit_error(
                    ExecutionError(
                        name="TimeoutError",
                        value=f"the code ran past its time limit of {limit:g} s and was stopped",
                    )
                )
        except asyncio.CancelledError:  # the caller left: its code is stopped, in the background
            self._handed = True  # with the sandbox's lock and the run's id, until it is stopped
            stopping = asyncio.ensure_future(self._stop_left(run_id, pending))
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
            raise
        except SandboxError as exc:
            if self._closed:
                raise
            status, state_lost = ExecutionStatus.KERNEL_DIED, True
            notice = f"{exc}; a fresh interpreter replaced it"
            await self._recover()
            outcome = {}
        finally:
            if not self._handed:
                self._pending.pop(run_id, None)
                self._run_id = None
        if status is ExecutionStatus.OK and outcome.get("status") == "interrupted":
            status = ExecutionStatus.CANCELLED  # interrupted on request (`interrupt`)
        elif status is ExecutionStatus.OK and outcome.get("status") != "ok":
            status = ExecutionStatus.ERROR
        if state_lost and notice is None:
            notice = "the code did not stop when interrupted: a fresh interpreter replaced it"
        count = outcome.get("count")
        collector.execution_count = count if isinstance(count, int) else None
        return collector.build(
            status=status,
            duration_s=time.monotonic() - clock,
            started_at=started,
            state_lost=state_lost,
            notice=notice,
        )

    async def _interrupt(self, run_id: int, pending: Pending) -> tuple[dict[str, Any], bool]:
        """Interrupt the running code; (its outcome, whether the worker had to be replaced)."""
        with contextlib.suppress(SandboxError):
            await self._send({"op": "interrupt", "id": run_id})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.spec.interrupt_grace_s):
                    return await asyncio.shield(pending.done), False
        await self._recover()
        return {}, True

    async def _stop_left(self, run_id: int, pending: Pending) -> None:
        """A run whose caller left: interrupted (the worker replaced only if it does not
        stop), with the sandbox's lock its caller held, so nothing else runs meanwhile."""
        try:
            with contextlib.suppress(SandboxError):
                await self._interrupt(run_id, pending)
        finally:
            self._pending.pop(run_id, None)
            self._run_id = None
            self._running.release()

    async def _recover(self) -> None:
        """A fresh worker (the process too, if it ended or the worker will not start): the
        session's variables are gone, its files with them (they live in the interpreter's
        memory). SandboxError if not even a fresh process starts."""
        if self._closed:
            return
        if self._lost is None:
            try:
                await self._start_worker()  # host.mjs replaces the worker
                return
            except SandboxError:
                if self._closed:
                    return
        try:
            await self._restart_process()
        except SandboxStartError as exc:
            raise SandboxError(str(exc)) from None

    async def _restart_process(self) -> None:
        old, writer = self._process, self._writer
        self._fail_all(SandboxError("the wasm sandbox's process was replaced"))
        if writer is not None:
            writer.close()
        if old is not None and old.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, 9)
            await old.wait()
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        self._lost = None
        (self._root / "s").unlink(missing_ok=True)
        # Not undone by a caller that leaves meanwhile: a half-started process would close
        # the whole sandbox.
        await asyncio.shield(asyncio.ensure_future(self.start()))

    async def interrupt(self) -> bool:
        run_id = self._run_id
        if run_id is None:
            return False
        with contextlib.suppress(SandboxError):
            await self._send({"op": "interrupt", "id": run_id})
        return True

    async def restart(self, language: str | None = None) -> None:
        """A fresh interpreter and process: the session's variables go, and its files with them
        (they live in the interpreter's memory)."""
        if language not in (None, PYTHON):
            raise LanguageUnavailable(f"the wasm backend runs Python only (asked: {language})")
        async with self._running:
            if self._closed:
                raise SandboxClosed("the sandbox was closed")
            self._lost = self._lost or "restarted"
            try:
                await self._restart_process()
            except SandboxStartError as exc:
                raise SandboxError(str(exc)) from None

    async def set_env(self, env: dict[str, str]) -> None:
        self._env.update(env)

    # --- host tools: relayed by the service (orchestrator/cluster/tool_relay.py) -------------

    async def set_tool_manifest(self, manifest: bytes) -> None:
        await self._tools.set_manifest(manifest)

    async def tool_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        if self._closed:
            raise SandboxClosed("the sandbox was closed")
        return await self._tools.queue.next_calls(max_wait_s)

    async def answer_tool_call(self, key: str, body: bytes) -> None:
        await self._tools.queue.answer(key, body)

    # --- files ------------------------------------------------------------------------------

    async def _call(self, fn: str, *args: Any) -> Any:
        ready = self._ready
        if ready is not None and not ready.done():  # a worker starting: asked once it runs
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(START_S):
                    await asyncio.wait({ready})
        call_id = next(self._ids)
        pending = Pending(None)
        self._pending[call_id] = pending
        generation = self._generation
        try:
            await self._send({"op": "call", "id": call_id, "fn": fn, "args": list(args)})
            async with asyncio.timeout(CALL_S):
                answer = await asyncio.shield(pending.done)
        except TimeoutError:
            answer = await self._late_answer(pending, generation)
        finally:
            self._pending.pop(call_id, None)
        if not isinstance(answer, dict):
            raise SandboxError("the wasm sandbox answered a file call with something else")
        if answer.get("ok") is True:
            return answer.get("value")
        text = str(answer.get("message", ""))[:1000]
        if answer.get("kind") == "missing":
            raise FileMissing(text)
        if answer.get("kind") == "too_large":
            raise FileTooLarge(text)
        raise InvalidPath(text)

    async def _late_answer(self, pending: Pending, generation: int) -> Any:
        """A call not answered in time: behind a long cell (its answer may come once the cell
        ends), or to a worker that is stuck or gone, which is then replaced."""
        async with self._running:
            if pending.done.done():
                return pending.done.result()
            if generation == self._generation:
                with contextlib.suppress(SandboxError):
                    await self._recover()
        raise SandboxError(
            f"the wasm sandbox did not answer a file call in {CALL_S:g} s: a fresh interpreter "
            "replaced it (the session's variables and files are gone)"
        )

    async def upload(self, path: str, data: bytes) -> FileInfo:
        relative = "/".join(clean_path(path))
        limit = min(self.spec.limits.workspace_size_mb << 20, MAX_FILE)
        if len(data) > limit:
            raise FileTooLarge(
                f"{len(data)} bytes is over the {limit} bytes a file of a wasm sandbox may hold "
                "(its workspace's size, and what one message carries)"
            )
        quota = self.spec.limits.workspace_size_mb << 20
        encoded = base64.b64encode(data).decode()
        return file_info(await self._call("write", relative, encoded, quota))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        relative = "/".join(clean_path(path))
        encoded = await self._call("read", relative, min(max_bytes, MAX_FILE))
        if not isinstance(encoded, str):
            raise SandboxError("the wasm sandbox answered a read with something else")
        try:
            data = base64.b64decode(encoded, validate=True)
        except ValueError:
            raise SandboxError("the wasm sandbox answered a read with bad base64") from None
        if len(data) > max_bytes:
            raise FileTooLarge(f"{path} is over the {max_bytes} bytes asked for at most")
        return data

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        relative = "/".join(clean_path(path, allow_root=True))
        found = await self._call("list", relative, recursive)
        if not isinstance(found, list):
            raise SandboxError("the wasm sandbox answered a listing with something else")
        return [file_info(entry) for entry in found[:100_000]]

    async def remove_file(self, path: str) -> None:
        await self._call("remove", "/".join(clean_path(path)))
