"""Run inside Pyodide (the wasm sandbox's worker), never imported by the service: executes a
session's cells and answers its file calls. Everything it sends is JSON text the service checks.

A cell runs in one namespace for the sandbox's life; its last expression's value is shown as
Jupyter would (its `_repr_*_` forms). Files live in the interpreter's memory under /workspace.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import hashlib
import importlib
import importlib.metadata
import io
import json
import math
import os
import random
import re
import shutil
import stat
import sys
import sysconfig
import time
import traceback
import types
import zipfile
from collections.abc import Callable
from typing import Any, SupportsIndex

from pyodide.code import eval_code_async

WORKSPACE = "/workspace"
TOOLS_DIR = "/run/host-tools"  # host_tools.py and its manifest, when the session has tools
ORIGIN_ENV = "CIR_TOOL_ORIGIN"  # the run's origin, as the service names it (host_channel.py)
_FORMS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/json", "_repr_json_"),
)


class TooLarge(Exception):
    pass


class Driver:
    def __init__(self) -> None:
        os.makedirs(WORKSPACE, exist_ok=True)
        os.chdir(WORKSPACE)
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        self.count = 0
        self._running: asyncio.Task[Any] | None = None  # the run's task, while it runs
        self._interrupted = False  # the run was cancelled by `interrupt`, not by its own code

    def interrupt(self) -> None:
        """End the run where it waits (an await, a host tool call): worker.mjs calls this when
        the run is not running Python, so the interrupt flag would not reach its code."""
        if self._running is not None:
            self._interrupted = True
            self._running.cancel()

    async def run(
        self, code: str, env_json: str, cwd: str, emit: Callable[[str, str], None]
    ) -> str:
        """Run a cell with its own environment variables (put back after it, as on the other
        backends) and, for its host tool calls and those of tasks it starts, its origin."""
        self.count += 1
        env = json.loads(env_json)
        origin = TOOL_ORIGIN.set(env.pop(ORIGIN_ENV, None))
        previous = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        where = _inside(cwd) if cwd else WORKSPACE
        self._running = asyncio.current_task()
        self._interrupted = False
        try:
            os.makedirs(where, exist_ok=True)
            os.chdir(where)
            value = await eval_code_async(
                code, globals=self.namespace, filename=f"<cell-{self.count}>"
            )
        except BaseException as exc:  # KeyboardInterrupt too: the time limit's
            if isinstance(exc, asyncio.CancelledError) and self._interrupted:
                exc = KeyboardInterrupt().with_traceback(exc.__traceback__)  # ended where it waited
            emit("error", json.dumps(_error(exc)))
            interrupted = isinstance(exc, KeyboardInterrupt)
            return json.dumps({"status": "interrupted" if interrupted else "error"})
        finally:
            task, self._running = self._running, None
            while task is not None and task.cancelling():  # the run's answer still goes out
                task.uncancel()
            TOOL_ORIGIN.reset(origin)
            for key, value_before in previous.items():
                if value_before is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value_before
        if value is not None:
            self.namespace["_"] = value
            bundle = {"data": _bundle(value), "execution_count": self.count}
            emit("execute_result", json.dumps(bundle))
        return json.dumps({"status": "ok", "count": self.count})

    def set_tools(self, manifest: str, module: str) -> None:
        """The session's host tools: `import host_tools` finds them (a new manifest is read at
        the next import)."""
        os.makedirs(TOOLS_DIR, exist_ok=True)
        with open(os.path.join(TOOLS_DIR, "manifest.json"), "w") as out:
            out.write(manifest)
        with open(os.path.join(TOOLS_DIR, "host_tools.py"), "w") as out:
            out.write(module)
        if TOOLS_DIR not in sys.path:
            sys.path.append(TOOLS_DIR)
        sys.modules.pop("host_tools", None)
        sys.modules.pop("host_tools.sync", None)
        importlib.invalidate_caches()

    def call(self, fn: str, args_json: str) -> str:
        try:
            value = getattr(self, "file_" + fn)(*json.loads(args_json))
        except FileNotFoundError as exc:
            return json.dumps({"ok": False, "kind": "missing", "message": str(exc)})
        except TooLarge as exc:
            return json.dumps({"ok": False, "kind": "too_large", "message": str(exc)})
        except (OSError, ValueError) as exc:
            return json.dumps({"ok": False, "kind": "refused", "message": str(exc)})
        return json.dumps({"ok": True, "value": value})

    # --- files, by paths the service checked already (relative, no '..'), checked again
    def file_write(self, path: str, data_b64: str, quota: int) -> dict[str, Any]:
        """Write a file, the workspace's whole size kept within `quota` bytes (the file it
        replaces not counted)."""
        target = _inside(path)
        if os.path.islink(target):  # as on every backend: a link the code planted is refused
            raise ValueError(f"{path} is a symbolic link; a file is written only in its place")
        data = base64.b64decode(data_b64)
        replaced = os.lstat(target).st_size if os.path.isfile(target) else 0
        used = _workspace_bytes() - replaced
        if used + len(data) > quota:
            raise TooLarge(
                f"{path}: {len(data)} bytes more would take the workspace past its quota of "
                f"{quota} bytes ({used} in use): remove files first"
            )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as out:
            out.write(data)
        return _info(target)

    def file_read(self, path: str, max_bytes: int) -> str:
        target = _inside(path)
        size = os.stat(target).st_size
        if size > max_bytes:
            raise TooLarge(
                f"{path} is {size} bytes, over the {max_bytes} bytes a wasm sandbox's file may "
                "be moved at"
            )
        with open(target, "rb") as source:
            return base64.b64encode(source.read(max_bytes + 1)).decode()

    def file_list(self, path: str, recursive: bool) -> list[dict[str, Any]]:
        root = _inside(path) if path else WORKSPACE
        found: list[dict[str, Any]] = []
        if recursive:
            for here, dirs, files in os.walk(root):
                found += [_info(os.path.join(here, name)) for name in sorted(dirs + files)]
        else:
            found = [_info(os.path.join(root, name)) for name in sorted(os.listdir(root))]
        return found

    def file_remove(self, path: str) -> None:
        target = _inside(path)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.remove(target)
        return None


def _workspace_bytes() -> int:
    total = 0
    for here, _, files in os.walk(WORKSPACE):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(here, name)).st_size
    return total


def _inside(path: str) -> str:
    target = os.path.normpath(os.path.join(WORKSPACE, path))
    if target != WORKSPACE and not target.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return target


def _info(target: str) -> dict[str, Any]:
    st = os.lstat(target)
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    return {
        "path": os.path.relpath(target, WORKSPACE),
        "type": kind,
        "size": st.st_size,
        "modified_at": st.st_mtime,
    }


def _bundle(value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"text/plain": repr(value)}
    for mime, method in _FORMS:
        form = getattr(value, method, None)
        if not callable(form):
            continue
        try:
            shown = form()
        except Exception:
            continue
        if shown is None:
            continue
        if isinstance(shown, bytes):
            shown = base64.b64encode(shown).decode()
        data[mime] = shown if mime == "application/json" else str(shown)
    return data


def _error(exc: BaseException) -> dict[str, Any]:
    """The traceback as the code's own frames tell it (the interpreter's machinery left out)."""
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if f.filename.startswith("<cell-") or not f.filename.startswith("<")]
    frames = frames[next((i for i, f in enumerate(frames) if f.filename.startswith("<cell-")), 0) :]
    lines = ["Traceback (most recent call last):"] if frames else []
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(exc), exc)
    return {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": [line.rstrip("\n") for line in lines],
    }


def _sleep(seconds: float | SupportsIndex, /) -> None:
    """time.sleep as a wait the worker can end: an interrupt (a time limit) raises
    KeyboardInterrupt here, and the session keeps its state. Pyodide's own sleep waits out its
    whole time, whatever the flag says. Its arguments are refused as CPython's are."""
    if isinstance(seconds, str | bytes) or not hasattr(seconds, "__float__"):
        raise TypeError(f"'{type(seconds).__name__}' object cannot be interpreted as an integer")
    seconds = float(seconds)
    if math.isnan(seconds):
        raise ValueError("Invalid value NaN (not a number)")
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    if seconds > _LONGEST_SLEEP_S:
        raise OverflowError("sleep length is too large")
    from pyodide.ffi import can_run_sync, run_sync

    if not can_run_sync():  # not within a run (a callback of JavaScript's): as Pyodide does
        _PYODIDE_SLEEP(seconds)
        return
    import js

    try:
        run_sync(js.cirSleep(seconds * 1000))
    except Exception as exc:  # rejected: the run was interrupted
        raise KeyboardInterrupt(str(getattr(exc, "message", None) or exc)) from None


_LONGEST_SLEEP_S = (2**31 - 1) / 1000  # a JavaScript timer's longest
_PYODIDE_SLEEP = time.sleep
time.sleep = _sleep


# --- packages: the Pyodide distribution's own (compiled ones too, where the operator's copy has
# them), then pure-Python wheels from the operator's directory; both read-only to the sandbox

WHEELS = str(globals().pop("_cir_wheels", ""))  # set by worker.mjs before this runs
PYODIDE = str(globals().pop("_cir_pyodide", "")).rstrip("/")  # the distribution's directory
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-[^-]+)?-[^-]+-none-any\.whl$")


class Micropip(types.ModuleType):
    """`await micropip.install("name")`, as in Pyodide, but only from what this service holds:
    the packages of its Pyodide distribution whose files it has (with what they need), else the
    operator's pure-Python wheels. Nothing is ever fetched."""

    async def install(
        self, requirements: str | list[str], keep_going: bool = False, deps: bool = True
    ) -> None:
        names = [requirements] if isinstance(requirements, str) else list(requirements)
        done: set[str] = set()
        for requirement in names:
            await _install(requirement, deps, done)
        importlib.invalidate_caches()

    def list(self) -> dict[str, str]:
        return {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


async def _install(requirement: str, deps: bool, done: set[str]) -> None:
    name = re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]
    key = _normalized(name)
    if key in done:
        return
    done.add(key)
    try:
        importlib.metadata.distribution(name)
        return  # there already
    except importlib.metadata.PackageNotFoundError:
        pass
    packaged = _in_distribution(key)
    if packaged is not None:
        await _load_package(packaged)
        return
    wheel = _wheel_of(key)
    if wheel is None:
        raise ValueError(
            f"no package {name!r} among those this service offers: not in its Pyodide "
            "distribution's files, nor a pure-Python wheel in its wheels directory; ask its "
            f"operator to add it (`code-interpreter wasm fetch {name}`, or a full Pyodide "
            "distribution as wasm_pyodide_dir)"
        )
    needs = _unpack(wheel)
    if deps:
        for line in needs.splitlines():
            if line.startswith("Requires-Dist:") and ";" not in line:
                await _install(line.split(":", 1)[1], deps, done)


def _unpack(wheel: str) -> str:
    """A wheel of the wheels directory unpacked into site-packages; its metadata's text."""
    import js  # Pyodide's door to Deno: the worker may read the wheels' directory, no more

    data = bytes(js.Deno.readFileSync(f"{WHEELS}/{wheel}").to_py())
    site = sysconfig.get_paths()["purelib"]
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for member in archive.namelist():
            target = os.path.normpath(os.path.join(site, member))
            if not target.startswith(site + "/"):
                raise ValueError(f"{wheel} holds a path outside site-packages: {member}")
        archive.extractall(site)
        metadata = next((m for m in archive.namelist() if m.endswith(".dist-info/METADATA")), None)
        return archive.read(metadata).decode(errors="replace") if metadata else ""


_LOCK: dict[str, dict[str, Any]] | None = None  # the distribution's packages, by normalized name


def _in_distribution(key: str) -> str | None:
    """The distribution's name for a package it lists and holds the file of; None if not (a
    release from npm lists its packages without their files: Pyodide would fetch them)."""
    global _LOCK
    if not PYODIDE:
        return None
    import js

    if _LOCK is None:
        try:
            listed = json.loads(str(js.Deno.readTextFileSync(f"{PYODIDE}/pyodide-lock.json")))
            _LOCK = {_normalized(n): p for n, p in listed.get("packages", {}).items()}
        except Exception:  # no lock file, or not one: only the wheels directory then
            _LOCK = {}
    package = _LOCK.get(key)
    if not isinstance(package, dict) or _file_of(package) is None:
        return None
    return str(package.get("name") or key)


def _file_of(package: dict[str, Any]) -> str | None:
    """The path of a package's file in the distribution's directory, if it is there: a name,
    never a URL or a path elsewhere."""
    name = package.get("file_name")
    if not isinstance(name, str) or not name or "/" in name or ":" in name or name[0] == ".":
        return None
    import js

    try:
        js.Deno.statSync(f"{PYODIDE}/{name}")
    except Exception:
        return None
    return f"{PYODIDE}/{name}"


def _verified(key: str, seen: set[str]) -> None:
    """The package's file, and those of what it needs, each as the distribution's lock says
    (its sha256): Pyodide's own check does not run under Deno (its fetch ignores `integrity`,
    and a file read skips it)."""
    import js

    assert _LOCK is not None
    seen.add(key)
    package = _LOCK.get(key)
    path = _file_of(package) if isinstance(package, dict) else None
    if package is None or path is None:
        raise ValueError(f"{key} is needed, and this service's Pyodide does not hold it")
    data = bytes(js.Deno.readFileSync(path).to_py())
    if hashlib.sha256(data).hexdigest() != package.get("sha256"):
        raise ValueError(f"{key}: its file does not match the distribution's lock; not loaded")
    for needed in package.get("depends") or []:
        if isinstance(needed, str) and _normalized(needed) not in seen:
            _verified(_normalized(needed), seen)


async def _load_package(name: str) -> None:
    """Pyodide's own loading, from the distribution's directory, of a package and what it
    needs, each file checked first (`_verified`)."""
    import js
    import pyodide_js

    _verified(_normalized(name), set())
    # Pyodide's messages go to a list of JavaScript's own (no Python proxy to outlive the call).
    said = js.Array.new()
    collect = js.Function.new("said", "return (m) => { said.push(String(m)); }")(said)
    quiet = js.Function.new("")
    await pyodide_js.loadPackage(name, messageCallback=quiet, errorCallback=collect)
    installed = {_normalized(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    if _normalized(name) not in installed:
        why = " ".join(str(m) for m in said) or "it is not installed after loading"
        raise ValueError(f"{name} could not be loaded from this service's Pyodide: {why}")


def _wheel_of(key: str) -> str | None:
    if not WHEELS:
        return None
    import js

    found = []
    for entry in js.Deno.readDirSync(WHEELS):
        match = _WHEEL_NAME.match(entry.name)
        if match and _normalized(match["name"]) == key:
            found.append(entry.name)
    return max(found, key=_version_order) if found else None


def _version_order(wheel: str) -> tuple[tuple[int, str], ...]:
    """A wheel's version as parts that sort as versions do (26.1 after 9.0)."""
    version = wheel.split("-")[1]
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.+]", version))


sys.modules["micropip"] = Micropip("micropip")
# What host_tools.py reads for a call's origin: the run that started the calling task.
TOOL_ORIGIN: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cir_tool_origin", default=None
)
_runtime = types.ModuleType("_cir_runtime")
_runtime.tool_origin = TOOL_ORIGIN  # type: ignore[attr-defined]
sys.modules["_cir_runtime"] = _runtime
os.environ.pop(ORIGIN_ENV, None)
# An interpreter restored from the memory snapshot (worker.mjs) has the snapshot's random
# state: each session draws its own from here (os.urandom is the host's, never the snapshot's).
random.seed()
_cir_driver = Driver()
