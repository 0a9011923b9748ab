"""Who calls the E2B routes, and which sandbox they reach.

The control plane is called with an API key in `X-API-Key` (one of this service's keys). The data
plane is called with the sandbox id in `E2b-Sandbox-Id` and the sandbox's access token, which the
control plane gave its owner, in `X-Access-Token` (or `E2B-Traffic-Access-Token`, which E2B's SDK
sends instead on its context calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from orchestrator.auth import client_address
from orchestrator.e2b_compatible.sandboxes import E2BRecord, E2BSandboxes
from orchestrator.request_context import ServiceDep
from orchestrator.sessions import Session

__all__ = ["ApiOwnerDep", "E2BDep", "Reached", "ReachedDep", "ServiceDep"]


async def get_e2b(request: Request) -> E2BSandboxes:
    sandboxes: E2BSandboxes = request.app.state.e2b
    return sandboxes


E2BDep = Annotated[E2BSandboxes, Depends(get_e2b)]


async def api_owner(request: Request) -> str:
    """The owner of the API key the SDK sends (`X-API-Key`), or 401."""
    key = request.headers.get("x-api-key", "")
    if not key:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        key = bearer if scheme.lower() == "bearer" else ""
    authenticate = request.app.state.authenticate
    if not key and not authenticate.disabled:
        raise HTTPException(401, "missing API key: send one of this service's keys as X-API-Key")
    owner: str = authenticate.owner_for_key(key, client_address(request))
    return owner


ApiOwnerDep = Annotated[str, Depends(api_owner)]


@dataclass
class Reached:
    record: E2BRecord
    session: Session


async def reached(request: Request, sandboxes: E2BDep) -> Reached:
    """The sandbox a data-plane call names and may open; otherwise it is gone (502)."""
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise HTTPException(400, "missing the E2b-Sandbox-Id header")
    token = request.headers.get("x-access-token") or request.headers.get("e2b-traffic-access-token")
    record, session = await sandboxes.reachable(sandbox_id, token)
    return Reached(record, session)


ReachedDep = Annotated[Reached, Depends(reached)]
