"""Volumes (docs/volumes.md): made, listed, read and deleted by their key; their files reached
from outside (upload, list, download, delete, make a directory); mounted with
POST /v1/sessions {"volumes": [{"volume_id", "path", "read_only"}]}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Query, Response, UploadFile

from code_interpreter_wire.results import FileInfo
from code_interpreter_wire.volumes import CreateVolumeRequest, VolumeInfo
from orchestrator.routes.deps import OwnerDep, ServiceDep
from orchestrator.routes.files import downloaded, read_upload
from sandbox.workspace_files import clean_path

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])


@router.post("", status_code=201, summary="Make a volume")
async def create_volume(
    body: CreateVolumeRequest, service: ServiceDep, owner: OwnerDep
) -> VolumeInfo:
    return await service.volumes.create(owner, body)


@router.get("", summary="List the caller's volumes, oldest first")
async def list_volumes(service: ServiceDep, owner: OwnerDep) -> list[VolumeInfo]:
    return await service.volumes.of_owner(owner)


@router.get("/{volume_id}", summary="Get a volume")
async def get_volume(volume_id: str, service: ServiceDep, owner: OwnerDep) -> VolumeInfo:
    return await service.volumes.get(owner, volume_id)


@router.delete("/{volume_id}", status_code=204, summary="Delete a volume (409 while mounted)")
async def delete_volume(volume_id: str, service: ServiceDep, owner: OwnerDep) -> Response:
    await service.volumes.delete(owner, volume_id)
    return Response(status_code=204)


@router.post("/{volume_id}/files", status_code=201, summary="Upload a file (field `file`)")
async def upload(
    volume_id: str,
    service: ServiceDep,
    owner: OwnerDep,
    file: Annotated[UploadFile, File(description="The file's content.")],
    path: Annotated[
        str | None, Query(description="Where in the volume; the upload's name if unset.")
    ] = None,
) -> FileInfo:
    target = path if path is not None else (file.filename or "")
    clean_path(target)  # refuse a bad name, or another key's volume, before reading a byte
    await service.volumes.check_writable(owner, volume_id)
    data = await read_upload(file, service.admission.upload_limit())
    return await service.volumes.upload(owner, volume_id, target, data)


@router.post("/{volume_id}/directories", status_code=204, summary="Make a directory")
async def make_directory(
    volume_id: str,
    service: ServiceDep,
    owner: OwnerDep,
    path: Annotated[str, Query(description="The directory, with its parents.")],
) -> Response:
    await service.volumes.make_directory(owner, volume_id, path)
    return Response(status_code=204)


@router.get("/{volume_id}/files", summary="List a directory of the volume")
async def list_files(
    volume_id: str,
    service: ServiceDep,
    owner: OwnerDep,
    path: Annotated[str, Query(description="A directory; the volume's root if unset.")] = "",
    recursive: bool = False,
) -> list[FileInfo]:
    return await service.volumes.list_files(owner, volume_id, path, recursive=recursive)


@router.get(
    "/{volume_id}/files/{path:path}",
    summary="Download a file",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download(volume_id: str, path: str, service: ServiceDep, owner: OwnerDep) -> Response:
    return downloaded(path, await service.volumes.download(owner, volume_id, path))


@router.delete("/{volume_id}/files/{path:path}", status_code=204, summary="Delete a file or tree")
async def delete_file(volume_id: str, path: str, service: ServiceDep, owner: OwnerDep) -> Response:
    await service.volumes.remove_file(owner, volume_id, path)
    return Response(status_code=204)
