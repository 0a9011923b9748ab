"""How errors read over HTTP: a status for each typed error of the sandbox layer, and invalid
input told back in one line (`where: what is wrong; ...`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from code_interpreter_wire.errors import (
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    CapacityReached,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    LanguageUnavailable,
    PortUnreachable,
    ProcessesUnsupported,
    ProcessLimitReached,
    ProcessNotFound,
    ProcessStateError,
    RootUnavailable,
    RuntimeUnavailable,
    SandboxClosed,
    SandboxError,
    SandboxLost,
    SandboxPausing,
    SandboxStartError,
    ScopeRefused,
    StateNotSaved,
    UnknownLanguage,
)

# Most specific first: the first match wins.
STATUS_OF_ERROR: list[tuple[type[Exception], int]] = [
    (InvalidPath, 400),
    (UnknownLanguage, 400),
    (LanguageUnavailable, 400),
    (ScopeRefused, 400),
    (RuntimeUnavailable, 400),
    (RootUnavailable, 403),
    (FileMissing, 404),
    (FileAccessError, 403),
    (FileTooLarge, 413),
    (SandboxPausing, 409),  # a pause through another replica: call again
    (SandboxClosed, 410),
    (SandboxLost, 410),  # a sandbox on a machine that died (cluster mode): SessionLost besides
    (ProcessNotFound, 404),
    (ProcessStateError, 409),
    (ProcessLimitReached, 429),
    (ProcessesUnsupported, 501),
    (BackendRateLimited, 429),
    (CapacityReached, 429),  # every node of the cluster is full: the message says how full
    (BackendTimeout, 504),
    (PortUnreachable, 502),  # a gateway's answer: the server behind it did not answer
    (BackendUnavailable, 503),
    (SandboxStartError, 503),
    (StateNotSaved, 409),
    (SandboxError, 500),
]


def status_of(exc: Exception, overrides: Mapping[type[Exception], int] | None = None) -> int | None:
    """The HTTP status of a typed error (an API's own `overrides` first), or None."""
    for kind, status in STATUS_OF_ERROR:
        if isinstance(exc, kind):
            return (overrides or {}).get(kind, status)
    return None


def problems(errors: Iterable[Mapping[str, Any]], *, whole: str = "") -> str:
    """pydantic's (or FastAPI's) `exc.errors()`, joined; `whole` names an error with no location."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or whole}: {e['msg']}" for e in errors)
