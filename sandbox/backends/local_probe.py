"""What the local backend's kernel interpreter is on this host, found once by running it: the
directories it needs that binding /usr does not give, where its environment is, whether it has
the Bash kernel, and (as root) that sandboxes running as other uids can reach all of it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.host_commands import HOST_ENVIRONMENT, resolve

# An install without the `kernel` extra has no ipykernel: say which extra, not "No module named".
KERNEL_MISSING_HINT = (
    "the kernel interpreter {python!r} has no ipykernel, which the local sandbox runs. Install "
    "the kernel extra into it: `pip install 'code-interpreter-runtime[kernel]'` (or set the "
    "local backend's `python` to an interpreter that has it)."
)
_PROBE = (
    "import sys, json, importlib.util as u; print(json.dumps([[sys.prefix, "
    "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], "
    "u.find_spec('ipykernel_launcher') is not None, "
    "u.find_spec('bash_kernel') is not None]))"
)


@dataclass(frozen=True)
class PythonProbe:
    roots: list[str]  # its prefixes outside /usr: bound read-only into each sandbox
    prefix: str
    has_bash_kernel: bool


def absolute_python(python: str) -> str:
    """The kernel's interpreter as an absolute path (a bare name is looked up in the system's
    directories), so that no PATH, the unsafe mode's included, ever chooses it."""
    return python if os.path.isabs(python) else resolve(python)


async def probe_python(
    python: str, *, configured: str, state_dir: Path, sandboxed_as_others: bool
) -> PythonProbe:
    """Run `python` (`configured`: the name the settings gave it, for messages) and say what it
    is; `sandboxed_as_others`: sandboxes run as other uids, so what they use must be reachable
    by anyone (the interpreter's roots and `state_dir`'s parent)."""
    proc = await asyncio.create_subprocess_exec(
        python,
        "-c",
        _PROBE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=HOST_ENVIRONMENT,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise BackendUnavailable(
            f"the kernel interpreter {configured!r} does not run: {err.decode()}"
        )
    prefixes, has_kernel, has_bash_kernel = json.loads(out)
    if not has_kernel:
        raise BackendUnavailable(KERNEL_MISSING_HINT.format(python=configured))
    roots = _outside_usr(prefixes)
    if sandboxed_as_others:
        for root in roots:
            _check_reachable_by_others(root, "the kernel's Python")
        _check_reachable_by_others(str(state_dir.parent), "the state dir")
    return PythonProbe(roots, prefixes[0], has_bash_kernel)


def _outside_usr(prefixes: list[str]) -> list[str]:
    """The prefixes (and where their symlinks lead) that binding /usr does not cover."""
    roots: list[str] = []
    for prefix in prefixes:
        for p in (prefix, os.path.realpath(prefix)):
            if p != "/usr" and not p.startswith("/usr/") and p not in roots:
                roots.append(p)
    return roots


def _check_reachable_by_others(path: str, what: str) -> None:
    """As root, sandboxes run as other uids: what they use must be reachable by anyone."""
    current = Path(path)
    for part in [current, *current.parents]:
        mode = part.stat().st_mode
        if not mode & 0o001:
            raise BackendUnavailable(
                f"{what} lives under {part}, which other users cannot enter "
                f"(mode {oct(mode & 0o777)}), and sandboxes run as an unprivileged uid. For "
                "the Python, create the environment from a system Python (e.g. "
                "`/usr/bin/python3 -m venv .venv`, as `make install` does); for the state "
                "dir, choose one under /tmp or /var/lib."
            )
