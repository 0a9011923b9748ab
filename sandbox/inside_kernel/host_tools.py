"""Tools of the host, callable from this sandbox as ordinary Python functions.

    import asyncio, host_tools
    team = await host_tools.get_team_members()         # each tool is an async function
    spent = await asyncio.gather(*[host_tools.get_expenses(m["id"]) for m in team])  # at once
    host_tools.sync.get_team_members()                 # the same call, blocking

Each call goes to the host, which checks the arguments against the tool's schema and runs it
with a time limit. Failures raise host_tools.ToolError, or one of its kinds: ToolArgumentError
(the arguments do not fit), ToolNotAllowed (not a tool of this session), ToolTimeout,
ToolTooLarge (the call or the result is over the size limit), ToolFailed (the tool raised; the
message is its error), ToolChannelError (the channel to the host is gone), ToolDenied (the call
needed a human's approval and was denied, or no one answered in time, or the execution or
process that started the calling thread has ended; the message says why).

A call is made on behalf of the execution (or command, background process, terminal) that
started the calling thread, task or process, and only while that one runs: a thread left
running by an earlier execution is refused.
"""

# Why: a model that writes one program calling many tools, and prints only the answer, spends far
# less context than one that calls each tool itself. Each call is one JSON frame over a Unix socket
# the orchestrator listens on (no network in the sandbox). Standard library only: the orchestrator
# copies this file as it is into the session's channel directory, next to `manifest.json` (the
# tools) and `sock` (the socket). In Pyodide (the wasm sandbox), where there are no sockets or
# threads, the same frames go through the worker's `cirHostTool` (worker.mjs) instead, and a
# blocking call waits with Pyodide's `run_sync`.

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import json
import keyword
import os
import socket
import sys
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

_DIR = os.path.dirname(os.path.abspath(__file__))
# Beside this module, or where the sandbox says (a gVisor machine's agent listens elsewhere:
# the directory is the host's, bound read-only, and its socket cannot be reached from inside).
_SOCKET = os.environ.get("CIR_HOST_TOOLS_SOCKET") or os.path.join(_DIR, "sock")
_MARGIN_S = 5.0  # the host enforces the time limit; this side only waits a little longer


class ToolError(Exception):
    """A host tool call failed; `type` says how (the subclasses below), the message why."""

    type = "error"


class ToolArgumentError(ToolError, ValueError):
    """The arguments do not match the tool's parameters."""

    type = "invalid_arguments"


class ToolNotAllowed(ToolError, PermissionError):
    """This session may not call that tool."""

    type = "not_allowed"


class ToolTimeout(ToolError, TimeoutError):
    """The tool did not answer within its time limit."""

    type = "timeout"


class ToolTooLarge(ToolError):
    """The call's arguments or its result are over the size limit."""

    type = "too_large"


class ToolFailed(ToolError):
    """The tool itself raised; the message is the host's exception, as `Type: message`."""

    type = "tool_error"


class ToolDenied(ToolError, PermissionError):
    """A human (or the time limit of waiting for one) denied the call, or the execution or
    process that started the caller has ended; the message says who and why. The tool did not
    run."""

    type = "denied"


class ToolChannelError(ToolError, ConnectionError):
    """The channel to the host is closed or refused the call."""

    type = "channel"


_ERRORS: dict[str, type[ToolError]] = {
    c.type: c
    for c in (
        ToolArgumentError, ToolNotAllowed, ToolTimeout, ToolTooLarge, ToolFailed, ToolDenied,
    )
}  # fmt: skip


class _Connection:
    """One socket per process; many calls in flight, answers matched by id."""

    def __init__(self, path: str, max_frame: int) -> None:
        self.path = path
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}

    async def call_async(
        self, tool: str, arguments: dict[str, Any], max_bytes: int, timeout_s: float
    ) -> Any:
        future = self.submit(tool, arguments, max_bytes)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except ToolError:
            raise
        except TimeoutError:
            raise ToolTimeout(f"{tool}: no answer from the host") from None

    def call_sync(
        self, tool: str, arguments: dict[str, Any], max_bytes: int, timeout_s: float
    ) -> Any:
        future = self.submit(tool, arguments, max_bytes)
        try:
            return future.result(timeout_s)
        except ToolError:
            raise
        except concurrent.futures.TimeoutError:
            raise ToolTimeout(f"{tool}: no answer from the host") from None

    def submit(
        self, tool: str, arguments: dict[str, Any], max_bytes: int
    ) -> concurrent.futures.Future[Any]:
        call_id = next(self._ids)
        frame = _call_frame(call_id, tool, arguments, max_bytes)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # an abandoned wait must not cancel it under us
        with self._lock:
            sock = self._connected()
            self._pending[call_id] = future
            try:
                sock.sendall(len(frame).to_bytes(4, "big") + frame)
            except OSError as exc:
                self._pending.pop(call_id, None)
                self._drop(sock, f"sending failed: {exc}")
                raise ToolChannelError(f"{tool}: the host tool channel broke: {exc}") from None
        return future

    def _connected(self) -> socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        if self._pid != os.getpid():  # a forked child: the parent's socket is not ours
            self._pending = {}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_SOCKET)
        except OSError as exc:
            sock.close()
            raise ToolChannelError(f"cannot reach the host tool channel: {exc}") from None
        self._sock, self._pid = sock, os.getpid()
        threading.Thread(target=self._read, args=(sock,), name="host-tools", daemon=True).start()
        return sock

    def _read(self, sock: socket.socket) -> None:
        why = "the host closed the tool channel"
        try:
            while True:
                head = _recv_exactly(sock, 4)
                if head is None:
                    break
                size = int.from_bytes(head, "big")
                if size > self.max_frame:
                    why = f"the host sent a frame of {size} bytes"
                    break
                body = _recv_exactly(sock, size)
                if body is None:
                    break
                reply = json.loads(body)
                if not isinstance(reply, dict):
                    why = "the host sent a frame that is not an object"
                    break
                with self._lock:
                    future = self._pending.pop(reply.get("id"), None)  # type: ignore[arg-type]
                if future is None:
                    error = reply.get("error") or {}
                    why = f"the host refused the channel: {error.get('message', reply)}"
                    if reply.get("id") is None:
                        break
                    continue
                try:
                    future.set_result(_result(reply))
                except ToolError as exc:
                    future.set_exception(exc)
        except (OSError, ValueError) as exc:
            why = f"the tool channel broke: {exc}"
        with self._lock:
            self._drop(sock, why)

    def _drop(self, sock: socket.socket, why: str) -> None:
        """Fail every call still waiting on `sock` (called with the lock held)."""
        if self._sock is sock:
            self._sock = None
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(ToolChannelError(why))
        sock.close()


_WASM_INTERRUPTED = "the run was interrupted"


class _WasmConnection:
    """In Pyodide: each call frame goes to the worker (`cirHostTool`, worker.mjs), which passes
    it to the service and settles the promise it gave with the answer frame's text."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def _sent(self, tool: str, arguments: dict[str, Any], max_bytes: int, timeout_s: float) -> Any:
        import js  # Pyodide's own

        # The worker gives the call an id of its own (ids here start again at a re-import).
        frame = _call_frame(next(self._ids), tool, arguments, max_bytes)
        return js.cirHostTool(frame.decode(), int(timeout_s * 1000))

    async def call_async(
        self, tool: str, arguments: dict[str, Any], max_bytes: int, timeout_s: float
    ) -> Any:
        promise = self._sent(tool, arguments, max_bytes, timeout_s)
        try:
            text = await promise
        except Exception as exc:  # a JsException: no answer in time, the run interrupted
            return _wasm_answer(tool, "failed", str(getattr(exc, "message", None) or exc))
        return _wasm_answer(tool, "ok", str(text))

    def call_sync(
        self, tool: str, arguments: dict[str, Any], max_bytes: int, timeout_s: float
    ) -> Any:
        from pyodide.ffi import can_run_sync, run_sync

        if not can_run_sync():  # checked before the call is made: it would run unwaited for
            raise ToolChannelError(
                f"{tool}: a blocking call cannot wait here (inside a JavaScript callback); "
                f"use `await host_tools.{tool}(...)`"
            )
        # The promise itself is waited on (not a coroutine around it): an interrupt that ends
        # the wait is then raised here, in the caller's frames.
        promise = self._sent(tool, arguments, max_bytes, timeout_s)
        try:
            text = run_sync(promise)
        except Exception as exc:
            return _wasm_answer(tool, "failed", str(getattr(exc, "message", None) or exc))
        return _wasm_answer(tool, "ok", str(text))


def _wasm_answer(tool: str, outcome: str, text: str) -> Any:
    if outcome != "ok" and _WASM_INTERRUPTED in text:  # worker.mjs: the run was interrupted
        raise KeyboardInterrupt(f"{tool}: {text}")
    if outcome != "ok":
        if "no answer" in text:
            raise ToolTimeout(f"{tool}: {text}")
        raise ToolChannelError(f"{tool}: {text}")
    try:
        reply = json.loads(text)
    except ValueError:
        raise ToolChannelError(f"{tool}: the host's answer is not JSON") from None
    if not isinstance(reply, dict):
        raise ToolChannelError(f"{tool}: the host's answer is not an object")
    return _result(reply)


def _call_frame(call_id: int, tool: str, arguments: dict[str, Any], max_bytes: int) -> bytes:
    call = {"id": call_id, "tool": tool, "arguments": arguments, "origin": _origin()}
    try:
        frame = json.dumps(call, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ToolArgumentError(f"{tool}: the arguments are not JSON: {exc}") from None
    if len(frame) > max_bytes:
        raise ToolTooLarge(f"{tool}: the call is {len(frame)} bytes, over the limit of {max_bytes}")
    return frame


def _result(reply: dict[str, Any]) -> Any:
    """An answer frame's result, or the ToolError it tells of."""
    if "error" in reply:
        error: dict[str, Any] = reply["error"] if isinstance(reply["error"], dict) else {}
        kind = _ERRORS.get(str(error.get("type")), ToolError)
        raise kind(error.get("message", "the call failed"))
    return reply.get("result")


def _origin() -> str | None:
    """What started this caller: in the kernel, the execution that started this thread or task
    (the start-up file keeps it); in a process, its starter's, from its environment. The host
    refuses a call whose origin no longer runs, and shows a human its code."""
    runtime = sys.modules.get("_cir_runtime")
    current = getattr(runtime, "tool_origin", None)
    if current is not None:
        value = current.get()
        return value if isinstance(value, str) else None
    return os.environ.get("CIR_TOOL_ORIGIN") or None


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


# --- from a JSON schema to a Python signature --------------------------------------------------

_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "object": dict,
    "null": type(None),
}


def _annotation(schema: Any) -> Any:
    """A readable Python annotation for a JSON schema (typing.Any when it is not simple)."""
    if not isinstance(schema, dict):
        return typing.Any
    try:
        if "enum" in schema and all(isinstance(v, str | int | bool) for v in schema["enum"]):
            return typing.Literal[tuple(schema["enum"])]
        options = schema.get("anyOf") or schema.get("oneOf")
        kind = schema.get("type")
        if options:
            found = [_annotation(o) for o in options]
        elif isinstance(kind, list):
            found = [_annotation({**schema, "type": k}) for k in kind]
        elif kind == "array":
            return list[_annotation(schema.get("items"))]  # type: ignore[misc]
        elif kind in _JSON_TYPES:
            return _JSON_TYPES[kind]
        else:
            return typing.Any
        result = found[0]
        for other in found[1:]:
            result = result | other
        return result
    except TypeError:
        return typing.Any


class _Tool:
    """What the manifest says of one tool, and the call it makes."""

    def __init__(self, spec: dict[str, Any], manifest: dict[str, Any]) -> None:
        self.name: str = spec["name"]
        self.description: str = spec.get("description") or ""
        self.schema: dict[str, Any] = spec.get("parameters") or {}
        self.returns: dict[str, Any] | None = spec.get("returns")
        self.timeout_s = float(spec.get("timeout_s") or manifest.get("timeout_s") or 60)
        self.requires_approval = bool(spec.get("requires_approval"))
        self.max_bytes = int(manifest.get("max_call_bytes", 1 << 20))
        props = self.schema.get("properties") or {}
        required = set(self.schema.get("required") or [])
        params: list[inspect.Parameter] = []
        self.omit_if_none: set[str] = set()
        odd_names = False
        ordered = [n for n in props if n in required] + [n for n in props if n not in required]
        for name in ordered:
            if not name.isidentifier() or keyword.iskeyword(name):
                odd_names = True  # passed as **{"name": value}
                continue
            prop = props[name] if isinstance(props[name], dict) else {}
            hint = _annotation(prop)
            if name in required:
                positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
                params.append(inspect.Parameter(name, positional, annotation=hint))
            else:
                if "default" not in prop:
                    self.omit_if_none.add(name)  # None: leave it out, the host's default holds
                default = prop.get("default")
                keyword_only = inspect.Parameter.KEYWORD_ONLY
                params.append(
                    inspect.Parameter(name, keyword_only, default=default, annotation=hint)
                )
        if odd_names:
            params.append(inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD))
        returns = _annotation(self.returns) if self.returns else inspect.Signature.empty
        self.signature = inspect.Signature(params, return_annotation=returns)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ToolArgumentError(f"{self.name}(): {exc}") from None
        out: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            param = self.signature.parameters[name]
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            elif not (value is None and name in self.omit_if_none):
                out[name] = value
        return out

    def doc(self, blocking: bool) -> str:
        props = self.schema.get("properties") or {}
        lines = [self.description.strip() or f"The host tool {self.name}."]
        if props:
            lines += ["", "Args:"]
            for name, prop in props.items():
                text = prop.get("description") if isinstance(prop, dict) else None
                lines.append(f"    {name}: {text}" if text else f"    {name}")
        if self.returns and self.returns.get("description"):
            lines += ["", f"Returns: {self.returns['description']}"]
        how = (
            f"host_tools.sync.{self.name}(...) blocks until the host answers"
            if blocking
            else f"await host_tools.{self.name}(...); many at once with asyncio.gather"
        )
        lines += [
            "",
            f"Runs on the host: {how}.",
            f"Time limit {self.timeout_s:g} s; a failure raises host_tools.ToolError.",
        ]
        if self.requires_approval:
            lines.append(
                "Each call waits for a human to approve it (within the time limit); a denial "
                "raises host_tools.ToolDenied with the reason."
            )
        return "\n".join(lines)


def _named(fn: Callable[..., Any], tool: _Tool, module: str, blocking: bool) -> None:
    fn.__name__ = fn.__qualname__ = tool.name
    fn.__doc__ = tool.doc(blocking)
    fn.__module__ = module
    fn.__signature__ = tool.signature  # type: ignore[attr-defined]


def _make(
    tool: _Tool, connection: _Connection | _WasmConnection
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    async def call_async(*args: Any, **kwargs: Any) -> Any:
        arguments = tool.arguments(args, kwargs)
        wait = tool.timeout_s + _MARGIN_S
        return await connection.call_async(tool.name, arguments, tool.max_bytes, wait)

    def call_sync(*args: Any, **kwargs: Any) -> Any:
        arguments = tool.arguments(args, kwargs)
        wait = tool.timeout_s + _MARGIN_S
        return connection.call_sync(tool.name, arguments, tool.max_bytes, wait)

    _named(call_async, tool, __name__, blocking=False)
    _named(call_sync, tool, f"{__name__}.sync", blocking=True)
    return call_async, call_sync


def _load() -> list[str]:
    """Read the manifest and put one async function per tool here, one blocking in `sync`."""
    with open(os.path.join(_DIR, "manifest.json"), "rb") as f:
        manifest = json.load(f)
    connection: _Connection | _WasmConnection
    if sys.platform == "emscripten":  # Pyodide: no sockets, no threads
        connection = _WasmConnection()
    else:
        connection = _Connection(_SOCKET, int(manifest.get("max_result_bytes", 8 << 20)) + 4096)
    this = sys.modules[__name__]
    names: list[str] = []
    lines = []
    for spec in manifest.get("tools", []):
        tool = _Tool(spec, manifest)
        call_async, call_sync = _make(tool, connection)
        setattr(this, tool.name, call_async)
        setattr(sync, tool.name, call_sync)
        names.append(tool.name)
        summary = tool.description.strip().split("\n", 1)[0]
        lines.append(f"    {tool.name}{tool.signature}: {summary}")
    sync.__all__ = list(names)  # type: ignore[attr-defined]
    listing = "\n".join(lines) or "    (none: this session may call no host tools)"
    this.__doc__ = f"{__doc__}\nTools of this session:\n{listing}\n"
    return names


sync = types.ModuleType(
    f"{__name__}.sync", "The same host tools as blocking functions: host_tools.sync.NAME(...)."
)
sys.modules[sync.__name__] = sync
_ERROR_NAMES = [
    "ToolError", "ToolArgumentError", "ToolNotAllowed", "ToolTimeout", "ToolTooLarge",
    "ToolFailed", "ToolChannelError", "ToolDenied",
]  # fmt: skip
# help(host_tools) shows the tools; the errors are named in the module's docstring.
__all__ = [*_load(), "sync"]


def __dir__() -> list[str]:
    return sorted([*__all__, *_ERROR_NAMES])


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"host_tools has no tool {name!r}; this session's tools: "
        f"{', '.join(sync.__all__) or 'none'} (see help(host_tools))"
    )


sync.__getattr__ = __getattr__  # type: ignore[method-assign]
