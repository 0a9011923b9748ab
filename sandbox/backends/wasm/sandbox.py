"""One wasm sandbox: a Deno process whose worker runs Pyodide (host.mjs, worker.mjs,
inside_pyodide.py), reached over a Unix socket in the sandbox's own directory.

The wall is Deno's permissions: the process may read Pyodide's files, its own scripts and its
socket, and nothing else (no network, environment, processes or other files), and the worker
running the session's Python may read only Pyodide's files. Everything that comes over the
socket is treated as the sandbox's word: frames are capped, each message's shape checked, its
outputs kept within the spec's limits (sandbox/kernel/collector.py).

A time limit interrupts the code (Pyodide's interrupt buffer); code that does not come back
within `INTERRUPT_GRACE_S` (stuck outside the interpreter) costs the worker: a fresh one
replaces it, and the session's variables are lost (said on the execution).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import socket
import struct
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
from sandbox.json_depth import nests_deeper_than
from sandbox.kernel.collector import RESULT_MAX_DEPTH, OutputCollector
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.kernel.wire import Malformed
from sandbox.workspace_paths import clean_path

HERE = Path(__file__).resolve().parent
DRIVER = (HERE / "inside_pyodide.py").read_text()
MAX_FRAME = 64 << 20  # either way; past it from the sandbox, it is ended
START_S = 60.0  # Pyodide's cold start is 2-5 s; a loaded machine may take much longer
INTERRUPT_GRACE_S = 3.0
CALL_S = 30.0


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
    ):
        self.id = sandbox_id
        self._wheels = wheels  # pure-Python wheels it may install: read-only to it
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
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._running = asyncio.Lock()
        self._closed = False
        self._lost: str | None = None

    # --- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start Deno and its worker and wait until Pyodide answers (or SandboxStartError)."""
        path = self._root / "s"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        listener.setblocking(False)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self._command(path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=self._root,
                env=self._process_env(),
                start_new_session=True,
            )
            assert self._process.stdout is not None
            self._tail = StdioTail(self._process.stdout)
            conn = await self._accept(listener)
            reader, self._writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 16)
            self._reader_task = asyncio.ensure_future(self._read(reader))
            await self._start_worker()
        except BaseException as exc:
            reason = await self._startup_failure(exc)
            await self.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise SandboxStartError(reason) from None
        finally:
            listener.close()

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
        readable = ",".join(str(p) for p in (self._pyodide, HERE, path, self._wheels) if p)
        heap_mb = self._heap_mb()
        return [
            self._deno,
            "run",
            "--no-prompt",
            "--no-config",
            "--no-lock",
            "--no-remote",
            "--no-npm",
            "--unstable-worker-options",
            f"--allow-read={readable}",
            f"--allow-write={path}",
            f"--allow-net=unix:{path}",  # its socket, and no other address
            f"--v8-flags=--max-old-space-size={heap_mb}",
            str(HERE / "host.mjs"),
            str(path),
            str(self._pyodide),
            str(self._wheels or ""),
        ]

    def _process_env(self) -> dict[str, str]:
        """Deno's own environment: nothing of the service's (the sandbox cannot read it anyway:
        no env permission), and its caches in the sandbox's directory."""
        return {"DENO_DIR": str(self._root / "deno"), "NO_COLOR": "1", "HOME": str(self._root)}

    async def _start_worker(self) -> None:
        self._ready = asyncio.get_running_loop().create_future()
        await self._send(self._init_message())
        async with asyncio.timeout(START_S):
            await self._ready

    def _init_message(self) -> dict[str, Any]:
        """A fresh worker: the driver, and the memory its interpreter may grow to (the spec's
        memory less what Deno's own heap may take)."""
        memory = (self.spec.limits.memory_mb - self._heap_mb()) << 20
        return {"op": "init", "driver": DRIVER, "memoryBytes": max(memory, 48 << 20)}

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
        if self._tail is not None:
            self._tail.stop()
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
        self._writer.write(struct.pack(">I", len(body)) + body)
        await self._writer.drain()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Take frames until the process ends; a frame over the cap or not JSON ends it."""
        why = "the wasm sandbox's process ended"
        try:
            while True:
                size = struct.unpack(">I", await reader.readexactly(4))[0]
                if size > MAX_FRAME:
                    why = f"the wasm sandbox sent a frame of {size} bytes, over the cap"
                    break
                message = json.loads(await reader.readexactly(size))
                await self._take(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (ValueError, RecursionError, Malformed) as exc:
            why = f"the wasm sandbox sent something unreadable: {exc}"
        self._lost = why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(SandboxError(why))
        self._fail_all(SandboxError(why))

    async def _take(self, message: Any) -> None:
        if not isinstance(message, dict):
            raise Malformed("a frame that is not an object")
        kind, body = message.get("type"), message.get("body")
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
            return
        if kind == "worker_error":
            self._fail_all(SandboxError(f"the wasm worker failed: {message.get('message')}"))
            return
        pending = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if pending is None:
            return  # late (after a time limit), or not ours: dropped
        if kind == "oversize":  # host.mjs would not carry it
            size = message.get("size")
            pending.fail(SandboxError(f"the sandbox's answer ({size} bytes) is over {MAX_FRAME}"))
            return
        if isinstance(body, str):
            await pending.take(str(kind), body)

    def _fail_all(self, error: SandboxError) -> None:
        for pending in list(self._pending.values()):
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
        where = "/".join(clean_path(_relative(cwd or self.spec.workdir), allow_root=True))
        async with self._running:
            return await self._execute(code, timeout_s, env, where, on_event)

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
        pending = _Pending(collector)
        run_id = next(self._ids)
        self._pending[run_id] = pending
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
                outcome, state_lost = await self._interrupt(pending)
                await collector.emit_error(
                    ExecutionError(
                        name="TimeoutError",
                        value=f"the code ran past its time limit of {limit:g} s and was stopped",
                    )
                )
        except asyncio.CancelledError:
            await self._interrupt(pending)
            raise
        except SandboxError as exc:
            if self._closed:
                raise
            status, state_lost = ExecutionStatus.KERNEL_DIED, True
            notice = f"{exc}; a fresh interpreter replaced it"
            await self._recover()
            outcome = {}
        finally:
            self._pending.pop(run_id, None)
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

    async def _interrupt(self, pending: _Pending) -> tuple[dict[str, Any], bool]:
        """Interrupt the running code; (its outcome, whether the worker had to be replaced)."""
        with contextlib.suppress(SandboxError):
            await self._send({"op": "interrupt"})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(INTERRUPT_GRACE_S):
                    return await asyncio.shield(pending.done), False
        await self._recover()
        return {}, True

    async def _recover(self) -> None:
        """A fresh worker (the process too, if it ended): the session's variables are gone,
        its files with them (they live in the interpreter's memory)."""
        if self._closed:
            return
        if self._lost is None:
            await self._send(self._init_message())  # host.mjs replaces the worker
            self._ready = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(START_S):
                await self._ready
            return
        await self._restart_process()

    async def _restart_process(self) -> None:
        old = self._process
        if old is not None and old.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, 9)
            await old.wait()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._lost = None
        (self._root / "s").unlink(missing_ok=True)
        await self.start()

    async def interrupt(self) -> bool:
        if not self._running.locked():
            return False
        with contextlib.suppress(SandboxError):
            await self._send({"op": "interrupt"})
        return True

    async def restart(self, language: str | None = None) -> None:
        if language not in (None, PYTHON):
            raise LanguageUnavailable(f"the wasm backend runs Python only (asked: {language})")
        async with self._running:
            self._lost = self._lost or "restarted"
            await self._restart_process()

    async def set_env(self, env: dict[str, str]) -> None:
        self._env.update(env)

    # --- files ------------------------------------------------------------------------------

    async def _call(self, fn: str, *args: Any) -> Any:
        call_id = next(self._ids)
        pending = _Pending(None)
        self._pending[call_id] = pending
        try:
            await self._send({"op": "call", "id": call_id, "fn": fn, "args": list(args)})
            async with asyncio.timeout(CALL_S):
                answer = await asyncio.shield(pending.done)
        except TimeoutError:
            raise SandboxError(
                f"the wasm sandbox did not answer a file call in {CALL_S:g} s"
            ) from None
        finally:
            self._pending.pop(call_id, None)
        if not isinstance(answer, dict):
            raise SandboxError("the wasm sandbox answered a file call with something else")
        if answer.get("ok") is True:
            return answer.get("value")
        text = str(answer.get("message", ""))[:1000]
        if answer.get("kind") == "missing":
            raise FileMissing(text)
        raise InvalidPath(text)

    async def upload(self, path: str, data: bytes) -> FileInfo:
        relative = "/".join(clean_path(path))
        limit = self.spec.limits.workspace_size_mb << 20
        if len(data) > limit:
            raise FileTooLarge(f"{len(data)} bytes is over the workspace's {limit} bytes")
        return _file_info(await self._call("write", relative, base64.b64encode(data).decode()))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        relative = "/".join(clean_path(path))
        encoded = await self._call("read", relative, max_bytes)
        if not isinstance(encoded, str):
            raise SandboxError("the wasm sandbox answered a read with something else")
        return base64.b64decode(encoded)

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        relative = "/".join(clean_path(path, allow_root=True))
        found = await self._call("list", relative, recursive)
        if not isinstance(found, list):
            raise SandboxError("the wasm sandbox answered a listing with something else")
        return [_file_info(entry) for entry in found[:100_000]]

    async def remove_file(self, path: str) -> None:
        await self._call("remove", "/".join(clean_path(path)))


class _Pending:
    """What one run or call waits for: its outputs (a run's) and its end."""

    def __init__(self, collector: OutputCollector | None) -> None:
        self.collector = collector
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def take(self, kind: str, body: str) -> None:
        """One message of the sandbox's for this run or call. One that cannot be read (not
        JSON, nested too deep, the wrong shape) is dropped and counted on a run, and fails a
        call."""
        if self.done.done():
            return
        try:
            await self._take(kind, body)
        except (ValueError, Malformed) as exc:
            if self.collector is not None:  # the run's own end comes from the driver
                self.collector.malformed_messages += 1
            else:
                self.fail(SandboxError(f"the wasm sandbox sent an unreadable {kind}: {exc}"))

    async def _take(self, kind: str, body: str) -> None:
        if kind in ("done", "reply", "failed"):
            answer = _parsed(body)
            if kind == "failed":
                self.done.set_exception(SandboxError(f"the wasm worker: {answer.get('message')}"))
            else:
                self.done.set_result(answer)
        elif self.collector is not None and kind in (
            "stream",
            "error",
            "execute_result",
            "display_data",
        ):
            await self.collector.handle_content(_parsed(body), kind)

    def fail(self, error: SandboxError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # read: a run that gave up on it leaves no warning


def _parsed(body: str) -> dict[str, Any]:
    """A message's JSON object, its depth measured before it is parsed (Python's parser
    raises RecursionError, not ValueError, on one nested some thousands deep)."""
    raw = body.encode()
    if nests_deeper_than(raw, RESULT_MAX_DEPTH):
        raise Malformed(f"a message nested deeper than {RESULT_MAX_DEPTH} levels")
    parsed = json.loads(raw)
    if not isinstance(parsed, dict):
        raise Malformed("a message that is not an object")
    return parsed


def _relative(path: str) -> str:
    """A working directory as the sandbox's code names it (under /workspace or /home/user, or
    relative to the workspace), relative to the workspace."""
    for root in ("/workspace", "/home/user"):
        if path == root or path.startswith(root + "/"):
            return path[len(root) :].lstrip("/")
    return path


def _file_info(entry: Any) -> FileInfo:
    if not isinstance(entry, dict):
        raise SandboxError("the wasm sandbox described a file with something else")
    return FileInfo(
        path=str(entry.get("path", "")),
        type=entry.get("type", "other"),
        size=int(entry.get("size", 0)),
        modified_at=datetime.fromtimestamp(float(entry.get("modified_at", 0)), UTC),
    )
