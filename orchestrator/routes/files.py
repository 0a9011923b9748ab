"""The session workspace's files: upload, list, download, delete. Paths stay inside it."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, File, HTTPException, Query, Response, UploadFile

from code_interpreter_wire.results import FileInfo
from orchestrator.routes.deps import ServiceDep, SessionDep
from sandbox.workspace_files import clean_path

router = APIRouter(prefix="/v1/sessions/{session_id}/files", tags=["files"])


@router.post("", status_code=201, summary="Upload a file (multipart field `file`)")
async def upload(
    session: SessionDep,
    service: ServiceDep,
    file: Annotated[UploadFile, File(description="The file's content.")],
    path: Annotated[
        str | None, Query(description="Where in the workspace; the upload's name if unset.")
    ] = None,
) -> FileInfo:
    target = path if path is not None else (file.filename or "")
    clean_path(target)  # refuse a bad name before reading a byte
    data = await read_upload(file, service.admission.upload_limit())
    return await service.files.upload(session, target, data)


async def read_upload(file: UploadFile, limit: int) -> bytes:
    """An upload's bytes, read in chunks and refused past `limit` before it is held whole (the
    service checks again)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await file.read(1 << 20):
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the upload is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.get("", summary="List a directory of the workspace")
async def list_files(
    session: SessionDep,
    service: ServiceDep,
    path: Annotated[str, Query(description="A directory; the workspace root if unset.")] = "",
    recursive: bool = False,
) -> list[FileInfo]:
    return await service.files.list_files(session, path, recursive=recursive)


@router.get(
    "/{path:path}",
    summary="Download a file",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download(path: str, session: SessionDep, service: ServiceDep) -> Response:
    return downloaded(path, await service.files.download(session, path))


def downloaded(path: str, data: bytes) -> Response:
    """A file's bytes as a download named as it is (volumes' downloads too)."""
    name = clean_path(path)[-1]
    ascii_name = name.encode("ascii", "replace").decode().replace("?", "_")
    ascii_name = ascii_name.replace("\\", "_").replace('"', "_")
    disposition = f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name)}"
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": disposition},
    )


@router.delete("/{path:path}", status_code=204, summary="Delete a file or directory")
async def delete(path: str, session: SessionDep, service: ServiceDep) -> Response:
    await service.files.remove_file(session, path)
    return Response(status_code=204)
