"""The /v1 routes' dependencies: the shared ones, and the session named in the path."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from orchestrator.request_context import (
    ClientGone,
    OwnerDep,
    ServiceDep,
    get_owner,
    get_service,
    owner_of,
    unless_disconnected,
)
from orchestrator.sessions import Session

__all__ = [
    "ClientGone",
    "OwnerDep",
    "ServiceDep",
    "SessionDep",
    "get_owner",
    "get_service",
    "owner_of",
    "unless_disconnected",
]


async def get_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> Session:
    return await service.lifecycle.get(session_id, owner)


SessionDep = Annotated[Session, Depends(get_session)]
