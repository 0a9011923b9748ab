"""Run code in isolation: result models, the kernel driver, the sandbox backends.

    from sandbox import create_backend
    backend = create_backend("local")
    async with await backend.create() as sb:
        execution = await sb.execute("1 + 1")

This package knows nothing of HTTP; the orchestrator builds the service on it. The models,
errors and spec load with it; the backends, their registry and `SyncSandbox` only when first
named, so that a client-only install (no Jupyter, no Docker) can use the models.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
from sandbox.spec import ResourceLimits, SandboxSpec

if TYPE_CHECKING:
    from sandbox.backends.base import Backend, Sandbox
    from sandbox.registry import BACKENDS, create_backend
    from sandbox.sync import SyncSandbox

# Exported names that load their module on first use: name -> module.
_LAZY = {
    "Backend": "sandbox.backends.base",
    "Sandbox": "sandbox.backends.base",
    "BACKENDS": "sandbox.registry",
    "create_backend": "sandbox.registry",
    "SyncSandbox": "sandbox.sync",
}


if not TYPE_CHECKING:  # hidden from mypy, so a misspelled name stays an error there

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
        value = getattr(import_module(module), name)
        globals()[name] = value  # found once
        return value


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
