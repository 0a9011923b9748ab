"""Puts the E2B-compatible front on the app: routers at `/` and `/e2b`, the Connect services."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from fastapi import FastAPI

from orchestrator.e2b_compatible import (
    contexts,
    control,
    execute,
    files,
    volume_content,
    volumes,
)
from orchestrator.e2b_compatible.connect_codecs import refusing_codecs
from orchestrator.e2b_compatible.filesystem import StripPrefix, WorkspaceFilesystem
from orchestrator.e2b_compatible.grpc_refusal import GrpcRefusal
from orchestrator.e2b_compatible.processes import SandboxProcesses
from orchestrator.e2b_compatible.sandboxes import E2BSandboxes
from orchestrator.service import Service

PREFIX = "/e2b"


def mount(app: FastAPI, service: Service) -> E2BSandboxes:
    """Serve E2B's control plane, volumes, code interpreter, files and processes; return the
    sandboxes' registry (its `start`/`close` run E2B's timeouts)."""
    sandboxes = E2BSandboxes(service)
    app.state.e2b = sandboxes
    routers = (
        control.router,
        execute.router,
        contexts.router,
        files.router,
        volumes.router,
        volume_content.router,
    )
    for router in routers:
        app.include_router(router)
    for router in routers:
        app.include_router(router, prefix=PREFIX, include_in_schema=False)
    connect_apps = (
        FilesystemASGIApplication(WorkspaceFilesystem(sandboxes), codecs=refusing_codecs()),
        ProcessASGIApplication(SandboxProcesses(sandboxes), codecs=refusing_codecs()),
    )
    for connect_app in connect_apps:
        served = GrpcRefusal(connect_app)
        app.mount(connect_app.path, served)
        app.mount(PREFIX + connect_app.path, StripPrefix(served, PREFIX))
    return sandboxes


@contextlib.asynccontextmanager
async def running(sandboxes: E2BSandboxes) -> AsyncIterator[None]:
    """The front while the service runs: its volume tokens' key read (or made) first, off the
    event loop (a damaged one stops the start), then E2B's timeouts swept."""
    await volumes.load_token_key(sandboxes.service)
    async with sandboxes.running():
        yield
