"""Backends by name, so configuration and the CLI can pick one with a string."""

from __future__ import annotations

from typing import Any

from sandbox.backends.base import Backend

BACKENDS = ("local", "docker")


def create_backend(name: str, **config: Any) -> Backend:
    """Make a backend: `local` (bubblewrap, the default) or `docker`."""
    if name == "local":
        from sandbox.backends.local import LocalBackend, LocalBackendConfig

        return LocalBackend(LocalBackendConfig(**config))
    if name == "docker":
        from sandbox.backends.docker import DockerBackend, DockerBackendConfig

        return DockerBackend(DockerBackendConfig(**config))
    raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
