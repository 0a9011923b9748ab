"""What every HTTP front door (ours and E2B's) needs of a request: the service it reaches, the
caller, and stopping work whose caller went away. Neutral ground: no routes live here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from orchestrator.service import Service

T = TypeVar("T")


# Dependencies are coroutines: FastAPI runs a plain function on a worker thread, a hop (and a
# wake-up of this loop) per dependency per request.
async def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def owner_of(request: Request) -> str:
    """The caller's owner id, authenticated (in memory: keys are held here), or 401."""
    owner: str = request.app.state.authenticate(request)
    return owner


async def get_owner(request: Request) -> str:
    return owner_of(request)


ServiceDep = Annotated[Service, Depends(get_service)]
OwnerDep = Annotated[str, Depends(get_owner)]


class ClientGone(Exception):
    """The caller disconnected; what it asked for was stopped."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (which interrupts the kernel)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
