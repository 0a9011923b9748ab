"""What every Connect service of the E2B front (filesystem, process) does around its calls: find
the sandbox a call names, and answer our typed errors with the Connect codes E2B's SDK maps to
its own exceptions (NOT_FOUND: `NotFoundException`, INVALID_ARGUMENT: `InvalidArgumentException`,
UNAVAILABLE "was not found": the sandbox is gone). A refusal (a key's policy, a human's denial) is
PERMISSION_DENIED, which the SDK raises as a `SandboxException` carrying the message: read as
"not found", the SDK would call a live sandbox dead."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from pydantic import ValidationError

from code_interpreter_wire.errors import (
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    ProcessesUnsupported,
    ProcessLimitReached,
    ProcessNotFound,
    ProcessStateError,
    RootUnavailable,
    SandboxClosed,
    SandboxError,
    SandboxPausing,
)
from orchestrator.e2b_compatible.sandboxes import E2BSandboxes, SandboxGone
from orchestrator.http_errors import problems
from orchestrator.sessions import Session, SessionError

T = TypeVar("T")

# What a session error says, as a Connect code; any other status: the session (the sandbox) is
# gone, as E2B's proxy says of a sandbox that is not there.
_SESSION_CODES = {
    400: Code.INVALID_ARGUMENT,
    403: Code.PERMISSION_DENIED,
    409: Code.FAILED_PRECONDITION,
    429: Code.RESOURCE_EXHAUSTED,
}


async def session_for(sandboxes: E2BSandboxes, ctx: RequestContext[Any, Any]) -> Session:
    """The session of the sandbox named by the call's headers (RequestGuard checked them)."""
    headers = ctx.request_headers
    sandbox_id = headers.get("e2b-sandbox-id") or ""
    token = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
    try:
        with connect_errors():  # a refusal to wake it (its key's policy) is said as one
            _, session = await sandboxes.reachable(sandbox_id, token)
    except SandboxGone as exc:
        raise ConnectError(Code.UNAVAILABLE, str(exc)) from None
    return session


@contextmanager
def connect_errors() -> Iterator[None]:
    """Our typed errors as Connect errors, each with its message (never a bare INTERNAL)."""
    try:
        yield
    except ConnectError:
        raise
    except ValidationError as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, problems(exc.errors())) from None
    except (FileMissing, ProcessNotFound) as exc:
        raise ConnectError(Code.NOT_FOUND, str(exc)) from None
    except (InvalidPath, FileAccessError) as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None
    except FileTooLarge as exc:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, str(exc)) from None
    except ProcessLimitReached as exc:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, str(exc)) from None
    except ProcessesUnsupported as exc:
        raise ConnectError(Code.UNIMPLEMENTED, str(exc)) from None
    except RootUnavailable as exc:  # E2B's answer for a user the sandbox will not run as
        raise ConnectError(Code.PERMISSION_DENIED, str(exc)) from None
    except ProcessStateError as exc:  # envd: "stdin not enabled or closed"
        raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from None
    except SandboxPausing as exc:  # paused through another replica: the next call resumes it
        raise ConnectError(Code.UNAVAILABLE, str(exc)) from None
    except SandboxClosed as exc:
        raise ConnectError(Code.UNAVAILABLE, f"The sandbox was not found: {exc}") from None
    except SessionError as exc:
        code = _SESSION_CODES.get(exc.status)
        if code is None:
            raise ConnectError(Code.UNAVAILABLE, f"The sandbox was not found: {exc}") from None
        raise ConnectError(code, str(exc)) from None
    except SandboxError as exc:
        raise ConnectError(Code.INTERNAL, str(exc)) from None


async def call(work: Awaitable[T]) -> T:
    """Await sandbox work under `connect_errors`."""
    with connect_errors():
        return await work
