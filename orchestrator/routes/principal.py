"""Who the caller's key is and what its policy allows: clients and the console ask before they
offer what the key may not do."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from orchestrator.governance.policy import Policy
from orchestrator.routes.deps import OwnerDep, ServiceDep

router = APIRouter(prefix="/v1", tags=["keys"])


class WhoAmI(BaseModel):
    id: str = Field(description="The owner id of the key's sessions (kept across rotations).")
    name: str
    admin: bool
    policy: Policy


@router.get("/whoami", summary="The caller's key: its name, whether it is an admin, its policy")
async def whoami(service: ServiceDep, owner: OwnerDep) -> WhoAmI:
    principal = service.admission.who(owner)
    return WhoAmI(
        id=principal.id, name=principal.name, admin=principal.admin, policy=principal.policy
    )
