"""Named snapshots: list, get, delete (taken with POST /v1/sessions/{id}/snapshots, used with
POST /v1/sessions {"snapshot_id": ...})."""

from __future__ import annotations

from fastapi import APIRouter, Response

from code_interpreter_wire.rest import SnapshotInfo
from orchestrator.routes.deps import OwnerDep, ServiceDep

router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"])


@router.get("", summary="List the caller's snapshots, newest first")
async def list_snapshots(service: ServiceDep, owner: OwnerDep) -> list[SnapshotInfo]:
    return await service.persistence.list_snapshots(owner)


@router.get("/{snapshot_id}", summary="Get a snapshot")
async def get_snapshot(snapshot_id: str, service: ServiceDep, owner: OwnerDep) -> SnapshotInfo:
    return await service.persistence.get_snapshot(owner, snapshot_id)


@router.delete("/{snapshot_id}", status_code=204, summary="Delete a snapshot")
async def delete_snapshot(snapshot_id: str, service: ServiceDep, owner: OwnerDep) -> Response:
    await service.persistence.delete_snapshot(owner, snapshot_id)
    return Response(status_code=204)
