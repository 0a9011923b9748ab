"""Run code in isolation: the kernel driver and the sandbox backends.

    from sandbox import create_backend
    backend = create_backend("local")
    async with await backend.create() as sb:
        execution = await sb.execute("1 + 1")

This package knows nothing of HTTP; the orchestrator builds the service on it. The models,
errors and spec it speaks are the wire's (`code_interpreter_wire`). The backends, their registry
and `SyncSandbox` load only when first named, so importing the package costs nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox.backends.base import Backend, Sandbox
    from sandbox.backends.registry import BACKENDS, create_backend
    from sandbox.sync import SyncSandbox

# Exported names that load their module on first use: name -> module.
_LAZY = {
    "Backend": "sandbox.backends.base",
    "Sandbox": "sandbox.backends.base",
    "BACKENDS": "sandbox.backends.registry",
    "create_backend": "sandbox.backends.registry",
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


__all__ = ["BACKENDS", "Backend", "Sandbox", "SyncSandbox", "create_backend"]
