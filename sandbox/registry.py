"""Backends by name, so configuration and the CLI can pick one with a string."""

from __future__ import annotations

from typing import Any

from sandbox.backends.base import Backend

BACKENDS = ("local", "docker", "e2b", "ray")


def create_backend(name: str, **config: Any) -> Backend:
    """Make a backend: `local` (bubblewrap, the default), `docker`, `e2b` or `ray` (a Ray
    cluster; Ray is imported only here, when asked for)."""
    if name == "local":
        from sandbox.backends.local import LocalBackend, LocalBackendConfig

        return LocalBackend(LocalBackendConfig(**config))
    if name == "docker":
        from sandbox.backends.docker import DockerBackend, DockerBackendConfig

        return DockerBackend(DockerBackendConfig(**config))
    if name == "e2b":
        from sandbox.backends.e2b_cloud import E2BBackend, E2BBackendConfig

        return E2BBackend(E2BBackendConfig(**config))
    if name == "ray":
        from sandbox.backends.ray_cluster.backend import RayBackend, RayBackendConfig

        return RayBackend(RayBackendConfig(**config))
    raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")


def why_unavailable(name: str, **config: Any) -> str | None:
    """Why a backend cannot run on this machine (with these or its default settings), or None."""
    if name == "local":
        import shutil

        return None if shutil.which("bwrap") else "bwrap is not installed"
    if name == "docker":
        import docker
        from docker.errors import DockerException, ImageNotFound

        from sandbox.backends.docker import DEFAULT_IMAGE

        try:
            client = docker.from_env()
            client.ping()
            client.images.get(DEFAULT_IMAGE)
        except ImageNotFound:
            return f"the image {DEFAULT_IMAGE} is missing: run `make image`"
        except DockerException as exc:
            return f"no Docker engine: {exc}"
        return None
    if name == "e2b":
        from sandbox.backends.e2b_cloud import E2BBackendConfig
        from sandbox.backends.e2b_cloud import why_unavailable as e2b_missing

        return e2b_missing(E2BBackendConfig(**config))
    if name == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            return "Ray is not installed: `pip install 'code-interpreter-runtime[cluster]'`"
        return None
    return f"unknown backend {name!r}"
