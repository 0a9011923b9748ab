"""Runs inside a Python kernel: saves the user's namespace to a file, and loads it back.

Sent as code by sandbox/kernel_state.py and run in a namespace of its own, so nothing is bound in
the user's. Standard library plus dill (made for serialising interpreter sessions: functions and
classes defined in cells are saved by value, modules by name, and a function's globals stay the
namespace's own). One pickle holds every saved name, so objects shared between names stay shared.
Each name that cannot be saved is reported with the reason, never silently dropped.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
from typing import Any

REPORT_MARK = "@@cir-state@@ "  # the report's line on stdout
_MAX_NAMED = 200  # names listed in a report at most (the counts are always whole)
# IPython's own names: input/output history and the shell's helpers.
_HISTORY = re.compile(r"^(_+|_i+|_\d+|_i\d+|_ih|_oh|_dh|In|Out|get_ipython|exit|quit)$")


class _OverCap(Exception):
    pass


class _Capped(io.RawIOBase):
    """A file that refuses to grow past `limit` bytes (or only counts, with no file)."""

    def __init__(self, target: Any, limit: int) -> None:
        self.target, self.limit, self.size = target, limit, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = len(data)
        self.size += n
        if self.size > self.limit:
            raise _OverCap()
        if self.target is not None:
            self.target.write(data)
        return n


def _shell() -> Any:
    from IPython import get_ipython

    return get_ipython()


def _user_names(shell: Any) -> dict[str, Any]:
    hidden = shell.user_ns_hidden
    return {
        name: value
        for name, value in shell.user_ns.items()
        if not (name.startswith("__") and name.endswith("__"))
        and not _HISTORY.match(name)
        and not (name in hidden and hidden[name] is value)
    }


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."


def _dump(dill: Any, names: dict[str, Any], target: Any, limit: int) -> int:
    sink = _Capped(target, limit)
    dill.dump(names, sink, recurse=False)
    return sink.size


def save(path: str, max_bytes: int) -> dict[str, Any]:
    """Write the namespace's names to `path`; say which were saved and why any were not."""
    try:
        import dill  # type: ignore[import-untyped]
    except ImportError:
        return {"error": "dill is not installed in this sandbox's Python: nothing can be saved"}
    shell = _shell()
    names = _user_names(shell)
    unsaved: dict[str, str] = {}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        try:
            size = _dump(dill, names, f, max_bytes)
        except Exception:
            size = -1
    if size < 0:  # find the names at fault, one by one, then save the others together
        sizes: dict[str, int] = {}
        for name, value in names.items():
            try:
                sizes[name] = _dump(dill, {name: value}, None, max_bytes)
            except _OverCap:
                unsaved[name] = f"larger than the snapshot limit of {max_bytes} bytes"
            except Exception as exc:
                unsaved[name] = _why(exc)
        kept = {n: v for n, v in names.items() if n not in unsaved}
        while True:
            try:
                with open(path, "wb") as f:
                    size = _dump(dill, kept, f, max_bytes)
                break
            except _OverCap:  # together too large: leave out the largest, and say so
                largest = max(kept, key=lambda n: sizes.get(n, 0))
                unsaved[largest] = (
                    f"{sizes.get(largest, 0)} bytes: the namespace is over the snapshot limit "
                    f"of {max_bytes} bytes with it"
                )
                kept.pop(largest)
            except Exception as exc:  # saved alone, not together: should not happen; say so
                for name in list(kept):
                    unsaved[name] = _why(exc)
                kept = {}
        names = kept
    saved = sorted(names)
    return {
        "saved": saved[:_MAX_NAMED],
        "saved_count": len(saved),
        "unsaved": dict(sorted(unsaved.items())[:_MAX_NAMED]),
        "unsaved_count": len(unsaved),
        "bytes": size,
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
    }


def restore(path: str, cwd: str | None) -> dict[str, Any]:
    """Load the names saved at `path` into the namespace (and go back to `cwd`)."""
    try:
        import dill
    except ImportError:
        return {"error": "dill is not installed in this sandbox's Python: nothing was restored"}
    if cwd is not None and os.path.isdir(cwd):
        os.chdir(cwd)
    try:
        with open(path, "rb") as f:
            names = dill.load(f)
    except Exception as exc:
        return {"error": f"the saved variables could not be loaded here: {_why(exc)}"}
    _shell().user_ns.update(names)
    restored = sorted(names)
    return {"restored": restored[:_MAX_NAMED], "restored_count": len(restored)}


def describe_files(root: str, skip: str, out: str, most: int) -> dict[str, Any]:
    """Write to `out` what copying the workspace's files out does not keep: each file's and
    directory's mode and time, and each symbolic link's target (`skip`: the staging directory,
    left out; at most `most` entries)."""
    entries: list[list[Any]] = []
    truncated = False
    for top, dirs, names in os.walk(root):
        rel_top = os.path.relpath(top, root)
        if rel_top == skip or rel_top.startswith(skip + os.sep):
            dirs[:] = []
            continue
        for name in dirs + names:
            full = os.path.join(top, name)
            rel = os.path.normpath(os.path.join(rel_top, name))
            if rel == skip:
                continue
            if len(entries) >= most:
                truncated = True
                break
            try:
                st = os.lstat(full)
                if os.path.islink(full):
                    entries.append([rel, "link", os.readlink(full), 0, 0.0])
                else:
                    entries.append([rel, "path", None, st.st_mode & 0o7777, st.st_mtime])
            except OSError:
                continue
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return {"entries": len(entries), "truncated": truncated}


def apply_files(root: str, source: str) -> dict[str, Any]:
    """Put back what `describe_files` wrote: links first, then modes and times (deepest first,
    so a directory's time is set after its contents are)."""
    with open(source, encoding="utf-8") as f:
        entries = json.load(f)
    applied, failed = 0, 0
    for rel, kind, target, mode, mtime in sorted(entries, key=lambda e: -str(e[0]).count("/")):
        full = os.path.join(root, rel)
        try:
            if kind == "link":
                if not os.path.lexists(full):
                    os.symlink(target, full)
            elif os.path.lexists(full) and not os.path.islink(full):
                os.chmod(full, mode)
                os.utime(full, (mtime, mtime))
            applied += 1
        except (OSError, TypeError, ValueError):
            failed += 1
    return {"applied": applied, "failed": failed}


def report(result: dict[str, Any]) -> None:
    sys.stdout.write(REPORT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
