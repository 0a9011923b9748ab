"""The credential vault (docs/secrets.md): a key's secrets stored, listed, read (never their
values) and deleted. Another key's secret is answered exactly like a missing one (404)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from code_interpreter_wire.secrets import SECRET_NAME_PATTERN, SecretInfo, SecretList
from orchestrator.routes.deps import OwnerDep, ServiceDep
from orchestrator.vault.public_suffixes import StoreSecretBody

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
NameParam = Annotated[str, Path(pattern=SECRET_NAME_PATTERN)]


@router.post(
    "",
    status_code=201,
    summary="Store a secret, or replace the one of that name (201 stored, 200 replaced)",
    responses={200: {"model": SecretInfo, "description": "Replaced the secret of that name"}},
)
async def store_secret(
    body: StoreSecretBody, response: Response, service: ServiceDep, owner: OwnerDep
) -> SecretInfo:
    info, replaced = await service.vault.put(owner, body)
    if replaced:
        response.status_code = 200
    return info


@router.get("", summary="List the caller's secrets: names and bindings, never values")
async def list_secrets(service: ServiceDep, owner: OwnerDep) -> SecretList:
    return SecretList(secrets=await service.vault.list(owner))


@router.get("/{name}", summary="Get a secret's binding (never its value)")
async def get_secret(name: NameParam, service: ServiceDep, owner: OwnerDep) -> SecretInfo:
    return await service.vault.get(owner, name)


@router.delete("/{name}", status_code=204, summary="Delete a secret")
async def delete_secret(name: NameParam, service: ServiceDep, owner: OwnerDep) -> Response:
    await service.vault.delete(owner, name)
    return Response(status_code=204)
