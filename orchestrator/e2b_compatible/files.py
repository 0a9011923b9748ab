"""E2B's file transfers (envd's `/files`): read a file, write files (multipart or octet-stream,
optionally gzip-compressed). Paths are E2B's: in the workspace (see paths.py) through the files
API, elsewhere in the sandbox (`/tmp`) through a command there (sandbox_files.py), as root
when E2B's `username` is `root` (where the sandbox has one: a gVisor machine; elsewhere refused,
saying so) and as the sandbox's one user otherwise. A signed URL (signed_urls.py) reads or writes
the one path it was signed for.
"""

from __future__ import annotations

import posixpath
import zlib
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from starlette.datastructures import UploadFile

from code_interpreter_wire.errors import FileTooLarge
from orchestrator.e2b_compatible import sandbox_files
from orchestrator.e2b_compatible.deps import ReachedDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.paths import in_sandbox, in_workspace, to_sandbox, to_workspace
from orchestrator.service import Service
from orchestrator.sessions import Session

router = APIRouter(route_class=E2BRoute, tags=["e2b"])
PathQuery = Annotated[
    str,
    Query(description="A path in the sandbox: /workspace (or /home/user) and below, or any other."),
]


@router.get(
    "/files",
    summary="E2B: read a file",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def read_file(
    reached: ReachedDep,
    service: ServiceDep,
    path: PathQuery,
    username: str | None = None,
) -> Response:
    if not in_workspace(path):
        limit = service.admission.download_limit()
        user = _user(username)
        data = await sandbox_files.read(service, reached.session, in_sandbox(path), limit, user)
        return Response(data, media_type="application/octet-stream")
    relative = to_workspace(path)
    if not relative:
        raise E2BError(400, f"{path!r} is a directory")
    data = await service.files.download(reached.session, relative)
    return Response(data, media_type="application/octet-stream")


@router.post("/files", summary="E2B: write files (multipart `file` parts, or an octet-stream)")
async def write_files(
    request: Request,
    reached: ReachedDep,
    service: ServiceDep,
    path: str | None = None,
    username: str | None = None,
) -> list[dict[str, Any]]:
    if any(name.lower().startswith("x-metadata-") for name in request.headers):
        raise E2BError(400, "file metadata is not supported by this server")
    limit = service.admission.upload_limit()
    written: list[tuple[str, bytes]] = []
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
        if not parts:
            raise E2BError(400, "no multipart part named `file`")
        if reached.signed and len(parts) > 1:
            raise E2BError(400, "a signed upload URL writes its one path: send one `file` part")
        for part in parts:
            target = path if path and len(parts) == 1 else part.filename
            if not target:
                raise E2BError(400, "a file part has no path: set ?path= or its filename")
            written.append((target, await _read_upload(part, limit)))
    else:
        if not path:
            raise E2BError(400, "an octet-stream upload needs ?path=")
        data = await _read_body(request, limit)
        written.append((path, data))
    user = _user(username)
    return [await _write(service, reached.session, target, data, user) for target, data in written]


def _user(username: str | None) -> sandbox_files.User:
    """Who transfers a file outside the workspace: root if E2B asks for it, else the sandbox's
    user (E2B's default names, `user` among them, are that user here)."""
    return "root" if username == "root" else None


async def _write(
    service: Service, session: Session, path: str, data: bytes, user: sandbox_files.User
) -> dict[str, Any]:
    if not in_workspace(path):
        service.admission.check_upload_size(len(data))
        absolute = in_sandbox(path)
        await sandbox_files.write(service, session, absolute, data, user)
        return {"name": posixpath.basename(absolute), "type": "file", "path": absolute}
    relative = to_workspace(path)
    if not relative:
        raise E2BError(400, "cannot write to the workspace directory itself")
    await service.files.upload(session, relative, data)
    return {"name": posixpath.basename(relative), "type": "file", "path": to_sandbox(relative)}


def _too_large(limit: int) -> FileTooLarge:
    """Said while reading, before the whole body is held: the service checks again on upload."""
    return FileTooLarge(f"the upload is larger than the limit of {limit} bytes")


async def _read_upload(part: UploadFile, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read(1 << 20):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, gunzipped if it says so, refused past `limit` (after decompression)."""
    gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        if inflate is not None:
            try:
                chunk = inflate.decompress(chunk, limit + 1 - size)
            except zlib.error as exc:
                raise E2BError(400, f"the gzip body is corrupt: {exc}") from None
            if inflate.unconsumed_tail:
                raise _too_large(limit)
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    if inflate is not None:
        chunks.append(inflate.flush())
    return b"".join(chunks)
