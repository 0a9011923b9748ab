"""Run code in isolation: result models, the kernel driver, the sandbox backends.

    from sandbox import create_backend
    backend = create_backend("local")
    async with await backend.create() as sb:
        execution = await sb.execute("1 + 1")

This package knows nothing of HTTP; the orchestrator builds the service on it.
"""

from sandbox.backends.base import Backend, Sandbox
from sandbox.errors import (
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)
from sandbox.models import (
    Artifact,
    DoneEvent,
    ErrorEvent,
    Execution,
    ExecutionError,
    ExecutionStatus,
    FileInfo,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)
from sandbox.registry import BACKENDS, create_backend
from sandbox.spec import ResourceLimits, SandboxSpec
from sandbox.sync import SyncSandbox

__all__ = [
    "BACKENDS",
    "Artifact",
    "Backend",
    "BackendRateLimited",
    "BackendTimeout",
    "BackendUnavailable",
    "DoneEvent",
    "ErrorEvent",
    "Execution",
    "ExecutionError",
    "ExecutionStatus",
    "FileAccessError",
    "FileInfo",
    "FileMissing",
    "FileTooLarge",
    "InvalidPath",
    "OutputEvent",
    "ResourceLimits",
    "Result",
    "ResultEvent",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxSpec",
    "SandboxStartError",
    "StderrEvent",
    "StdoutEvent",
    "SyncSandbox",
    "create_backend",
]
