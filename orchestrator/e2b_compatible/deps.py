"""Who calls the E2B routes, and which sandbox they reach.

The control plane is called with an API key in `X-API-Key` (one of this service's keys). The data
plane is called with the sandbox id in `E2b-Sandbox-Id` and the sandbox's access token, which the
control plane gave its owner, in `X-Access-Token` (or `E2B-Traffic-Access-Token`, which E2B's SDK
sends instead on its context calls), or `/files` with a URL that token signed (signed_urls.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from orchestrator.auth import client_address
from orchestrator.e2b_compatible.sandboxes import E2BRecord, E2BSandboxes
from orchestrator.e2b_compatible.signed_urls import signed_file_of
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
    signed: bool = False  # opened by a signed file URL: its one path and operation only


async def _reached(request: Request, sandboxes: E2BSandboxes, *, port_traffic: bool) -> Reached:
    token = request.headers.get("x-access-token") or request.headers.get("e2b-traffic-access-token")
    signed = signed_file_of(request) if token is None else None
    if signed is not None:
        record, session = await sandboxes.reachable(signed.sandbox_id, signed.token)
        return Reached(record, session, signed=True)
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise HTTPException(400, "missing the E2b-Sandbox-Id header")
    record, session = await sandboxes.reachable(sandbox_id, token, port_traffic=port_traffic)
    return Reached(record, session)


async def reached(request: Request, sandboxes: E2BDep) -> Reached:
    """The sandbox a data-plane call names and may open (or a signed file URL opened, as the
    request gate found); otherwise it is gone (502)."""
    return await _reached(request, sandboxes, port_traffic=False)


async def reached_on_its_port(request: Request, sandboxes: E2BDep) -> Reached:
    """As `reached`, for the code interpreter's own routes (run code, contexts): E2B serves
    them as a port of the sandbox, open to its public traffic (sandboxes.reachable)."""
    return await _reached(request, sandboxes, port_traffic=True)


ReachedDep = Annotated[Reached, Depends(reached)]
PortReachedDep = Annotated[Reached, Depends(reached_on_its_port)]
