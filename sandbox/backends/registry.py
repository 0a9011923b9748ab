"""Backends by name, so configuration and the CLI can pick one with a string.

A name maps to where its backend lives, as text: a backend's module is imported only when that
backend is asked for (Docker's SDK, Ray), and the backends may use this registry themselves (a
ray node makes a local or docker backend) without an import circle. What a backend can do is
declared on its class (`Backend.capabilities`), never decided here by its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any

from sandbox.backends.base import Backend


@dataclass(frozen=True, slots=True)
class _Entry:
    # "module:Name" of the Backend class.
    backend: str
    # "module:function" saying why it cannot run here (or None), given its configuration; in a
    # module that imports nothing the backend needs, so asking costs nothing when it is absent.
    availability: str


_ENTRIES = {
    "local": _Entry(
        "sandbox.backends.local:LocalBackend", "sandbox.backends.local:why_unavailable"
    ),
    "docker": _Entry(
        "sandbox.backends.docker:DockerBackend", "sandbox.backends.docker:why_unavailable"
    ),
    "gvisor": _Entry(
        "sandbox.backends.gvisor.backend:GvisorBackend",
        "sandbox.backends.gvisor.backend:why_unavailable",
    ),
    "e2b": _Entry(
        "sandbox.backends.e2b_cloud:E2BBackend", "sandbox.backends.e2b_cloud:why_unavailable"
    ),
    "ray": _Entry(
        "sandbox.backends.ray_cluster.backend:RayBackend",
        "sandbox.backends.ray_cluster.availability:why_unavailable",
    ),
    "microvm": _Entry(
        "sandbox.backends.microvm.backend:MicrovmBackend",
        "sandbox.backends.microvm.backend:why_unavailable",
    ),
    "wasm": _Entry(
        "sandbox.backends.wasm.backend:WasmBackend", "sandbox.backends.wasm.backend:why_unavailable"
    ),
}
BACKENDS = tuple(_ENTRIES)


def _load(path: str) -> object:
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


def _entry(name: str) -> _Entry:
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return entry


def backend_type(name: str) -> type[Backend]:
    """The class of the backend named `name` (its module imported now), to read what it can
    do (`capabilities`) before making one."""
    found = _load(_entry(name).backend)
    if not (isinstance(found, type) and issubclass(found, Backend)):
        raise TypeError(f"{_entry(name).backend} is not a Backend")
    return found


def create_backend(name: str, **config: Any) -> Backend:
    """Make a backend: `local` (bubblewrap, the default), `docker`, `gvisor` (machines over
    raw runsc), `e2b` or `ray` (a Ray cluster; Ray is imported only when asked for), from its
    configuration's fields."""
    return backend_type(name).configured(**config)


def why_unavailable(name: str, **config: Any) -> str | None:
    """Why a backend cannot run on this machine (with these or its default settings), or None."""
    entry = _ENTRIES.get(name)
    if entry is None:
        return f"unknown backend {name!r}"
    check = _load(entry.availability)
    if not callable(check):
        raise TypeError(f"{entry.availability} is not a function")
    why = check(**config)
    return None if why is None else str(why)
