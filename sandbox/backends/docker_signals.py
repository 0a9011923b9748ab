"""Signals to a process in a Docker sandbox, sent from inside its container (docker_processes.py
says why from inside and how far they reach): an exec of bash builtins, which needs no fork."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from docker.errors import APIError, DockerException, NotFound

from sandbox.backends.docker_exec_connection import engine_reason, take_connection
from sandbox.processes.spawned import CHUNK_BYTES

# $1 signal number, $2 process group (or empty), $3 marker (NAME=value). Builtins only: no fork.
_SIGNALLER = (
    '[ -z "$2" ] || kill -n "$1" -- "-$2" 2>/dev/null; '
    "for f in /proc/[0-9]*/environ; do "
    "p=${f#/proc/}; p=${p%/environ}; "
    "while IFS= read -r -d '' v; do "
    'if [[ $v == "$3" ]]; then kill -n "$1" "$p" 2>/dev/null; break; fi; '
    'done < "$f"; '
    "done 2>/dev/null; exit 0"
)
SIGNAL_ATTEMPTS = 10
# A signaller the sandbox stops or slows is given up on after this, its thread freed.
SIGNALLER_TIMEOUT_S = 20.0
# Signalling runs an exec as the sandbox's user, which the sandbox can slow or stop: on threads
# of its own, few, so a sandbox can hold up only other signals, never the service's shared pool.
SIGNALLERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="docker-signals")


def send_signal(
    api: Any, container: str, user: str, signum: int, group: int | None, marker: str
) -> None:
    """Signal a process's group (if known) and everything holding its marker, from an exec in
    the container; started again while the engine could not start it (a fork bomb may hold
    every pid for a moment), but never sent twice: a signaller that ran is not repeated."""
    command = [
        "/bin/bash", "-c", _SIGNALLER, "signal", str(int(signum)), str(group or ""), marker,
    ]  # fmt: skip
    for attempt in range(SIGNAL_ATTEMPTS):
        try:
            created = api.exec_create(container, command, stdout=True, stderr=True, user=user)
            why = _signaller_failure(api, created["Id"])
        except NotFound:
            raise ProcessLookupError("its container is gone") from None
        except (APIError, DockerException) as exc:
            if "is not running" in str(exc):
                raise ProcessLookupError("its container is not running") from None
            why = engine_reason(exc)
        if why is None:
            return
        if attempt == SIGNAL_ATTEMPTS - 1:
            raise OSError(f"could not signal the process: {why}")
        time.sleep(0.1 * (attempt + 1))


def _signaller_failure(api: Any, exec_id: str) -> str | None:
    """None once the signaller exec ran, else why the engine could not start it (worth another
    try). Its output is read to its end within a time limit (one the sandbox stops is given up
    on, never waited for: OSError, not repeated), then the engine says whether it ran at all."""
    connection, _ = take_connection(api.exec_start(exec_id, socket=True))
    deadline = time.monotonic() + SIGNALLER_TIMEOUT_S
    try:
        while True:
            connection.settimeout(max(deadline - time.monotonic(), 0.01))
            if not connection.recv(CHUNK_BYTES):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("it did not end in time")
    except OSError as exc:
        raise OSError(f"could not signal the process: its signaller failed: {exc}") from None
    finally:
        connection.close()
    state = api.exec_inspect(exec_id)
    if state.get("Pid"):  # it ran (its end may be reported a moment later): never repeated
        return None
    return f"the engine could not start its signaller (exit status {state.get('ExitCode')})"
