"""E2B's volume content API (`/volumecontent/{id}/...`, at `E2B_VOLUME_API_URL`, else
`https://api.<E2B_DOMAIN>`): a volume's files from outside, through `Service.volumes`.

Called with the volume's token (`Authorization: Bearer`, which E2B's control plane gave with the
volume: volumes.py; good for a day, and only while the key it was given to works) or one of
the service's API keys. Paths are the volume's own, `/` its root (`/a/b.txt` and `a/b.txt` are
one file). What the files' owners and modes are is the sessions' (every session's user may
change what another made: docs/volumes.md), so uid, gid and mode are neither set here nor
reported (0).
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any

from e2b.volume.client.models import VolumeEntryStat, VolumeEntryStatType
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response

from code_interpreter_wire.errors import FileMissing
from code_interpreter_wire.results import FileInfo
from orchestrator.auth import Authenticator, WrongKeysThrottled, client_address
from orchestrator.e2b_compatible.deps import ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BNamedRoute
from orchestrator.e2b_compatible.files import _read_body
from orchestrator.e2b_compatible.volumes import TOKEN_PREFIX, TokenRefused, owner_of_token
from orchestrator.key_throttle import TooManyWrongKeys
from orchestrator.service import Service

# Our refusals with their type in the message; a missing path 404 (the SDK's
# VolumePathNotFoundException), a refused one 400 (errors.py).
router = APIRouter(route_class=E2BNamedRoute, tags=["e2b"])
PREFIX = "/volumecontent/"
_VOLUME_OF_PATH = re.compile(r"/volumecontent/([^/]+)/")
_KINDS = {
    "file": VolumeEntryStatType.FILE,
    "directory": VolumeEntryStatType.DIRECTORY,
    "symlink": VolumeEntryStatType.SYMLINK,
}


# --- who calls
_CALLER = "volume_caller"  # in the request's state: the owner owner_of_call found


def owner_of_call(authenticate: Authenticator, service: Service, request: Request) -> str:
    """The owner a content call is made for: its volume token's (this volume's only), or its
    API key's; 401 otherwise. A wrong token counts as a wrong key against its address. Kept in
    the request's state (the request gate asks first: the route takes its answer)."""
    owner = _verified_owner(authenticate, service, request)
    setattr(request.state, _CALLER, owner)
    return owner


def _verified_owner(authenticate: Authenticator, service: Service, request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    token = token or request.headers.get("x-api-key", "")
    if not token and not authenticate.disabled:
        raise HTTPException(
            401,
            "missing the volume token: send 'Authorization: Bearer <token>' (Volume.create "
            "and Volume.get_info give it) or one of this service's keys as X-API-Key",
        )
    if not token.startswith(TOKEN_PREFIX):
        return authenticate.owner_for_key(token, client_address(request))
    found = _VOLUME_OF_PATH.match(request.url.path.removeprefix("/e2b"))
    volume_id = found.group(1) if found is not None else ""
    client = client_address(request)
    try:
        authenticate.throttle.before_check(client, token)
    except TooManyWrongKeys as refused:
        raise WrongKeysThrottled(refused) from None
    try:
        owner = owner_of_token(service, token, volume_id)
    except TokenRefused as refused:
        if refused.guessed:
            authenticate.throttle.failed(client, token)
        raise HTTPException(401, str(refused)) from None
    principals = authenticate.principals()
    if principals.is_revoked(owner):
        raise HTTPException(401, "the key this volume token was given to is revoked")
    if not principals.is_current(owner):
        raise HTTPException(
            401, "the key this volume token was given to is no longer one of this service's"
        )
    return owner


async def _caller(request: Request, service: ServiceDep) -> str:
    """The owner the request gate found for this call (request_guard.py), else found here."""
    found = getattr(request.state, _CALLER, None)
    if isinstance(found, str):
        return found
    authenticate: Authenticator = request.app.state.authenticate
    return owner_of_call(authenticate, service, request)


CallerDep = Annotated[str, Depends(_caller)]
PathQuery = Annotated[str, Query(description="In the volume; `/` is its root.")]


# --- its answers
def _inside(path: str) -> str:
    """A volume path as `Service.volumes` takes it: relative to the volume's root."""
    return path.strip().lstrip("/")


def _stat(info: FileInfo) -> dict[str, Any]:
    return VolumeEntryStat(
        name=posixpath.basename(info.path),
        type_=_KINDS.get(info.type, VolumeEntryStatType.UNKNOWN),
        path="/" + info.path,
        size=info.size,
        mode=0,
        uid=0,
        gid=0,
        atime=info.modified_at,
        mtime=info.modified_at,
        ctime=info.modified_at,
    ).to_dict()


async def _entry(service: Service, owner: str, volume_id: str, path: str) -> FileInfo:
    """One entry, by a stat of its own path (the root: the volume itself)."""
    inside = _inside(path)
    if posixpath.normpath("/" + inside) == "/":
        created = (await service.volumes.record(owner, volume_id)).created_at
        return FileInfo(path="", type="directory", size=0, modified_at=created)
    found = await service.volumes.stat(owner, volume_id, inside)
    if found is None:
        raise FileMissing(f"no such file or directory: {path!r}")
    return found


def _refuse_ownership(uid: int | None, gid: int | None, mode: int | None) -> None:
    if uid is not None or gid is not None or mode is not None:
        raise E2BError(
            400,
            "uid, gid and mode are not set on volume files here: a volume's files are every "
            "session's to read and write (docs/volumes.md); leave them out",
        )


# --- the routes
@router.get("/volumecontent/{volume_id}/dir", summary="E2B: list a directory of a volume")
async def list_dir(
    volume_id: str,
    path: PathQuery,
    service: ServiceDep,
    owner: CallerDep,
    depth: Annotated[int, Query(ge=1, le=64)] = 1,
) -> list[dict[str, Any]]:
    """Its entries, `depth` levels down (1: the directory's own); deeper ones are not walked."""
    listed = await service.volumes.list_files(
        owner, volume_id, _inside(path), recursive=depth > 1, max_depth=depth - 1
    )
    return [_stat(e) for e in listed]


@router.post("/volumecontent/{volume_id}/dir", status_code=201, summary="E2B: make a directory")
async def make_dir(
    volume_id: str,
    path: PathQuery,
    service: ServiceDep,
    owner: CallerDep,
    uid: int | None = None,
    gid: int | None = None,
    mode: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """With `force`, its missing parents too; without, a missing parent is 404."""
    _refuse_ownership(uid, gid, mode)
    inside = _inside(path)
    parent = posixpath.dirname(inside.rstrip("/"))
    if not force and parent:
        await _entry(service, owner, volume_id, parent)
    await service.volumes.make_directory(owner, volume_id, inside)
    return _stat(await _entry(service, owner, volume_id, inside))


@router.get("/volumecontent/{volume_id}/path", summary="E2B: a volume file's information")
async def stat(volume_id: str, path: PathQuery, service: ServiceDep, owner: CallerDep) -> Any:
    return _stat(await _entry(service, owner, volume_id, path))


@router.patch("/volumecontent/{volume_id}/path", summary="E2B: change a file's owner or mode")
async def update_metadata(volume_id: str, path: PathQuery, owner: CallerDep) -> None:
    _refuse_ownership(0, 0, 0)


@router.delete(
    "/volumecontent/{volume_id}/path", status_code=204, summary="E2B: remove a file or tree"
)
async def remove(
    volume_id: str, path: PathQuery, service: ServiceDep, owner: CallerDep
) -> Response:
    await service.volumes.remove_file(owner, volume_id, _inside(path))
    return Response(status_code=204)


@router.get(
    "/volumecontent/{volume_id}/file",
    summary="E2B: read a volume file",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def read_file(
    volume_id: str, path: PathQuery, service: ServiceDep, owner: CallerDep
) -> Response:
    data = await service.volumes.download(owner, volume_id, _inside(path))
    return Response(content=data, media_type="application/octet-stream")


@router.put("/volumecontent/{volume_id}/file", status_code=201, summary="E2B: write a volume file")
async def write_file(
    volume_id: str,
    path: PathQuery,
    request: Request,
    service: ServiceDep,
    owner: CallerDep,
    uid: int | None = None,
    gid: int | None = None,
    mode: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The body is the file (octet-stream, gunzipped if it says so): made with its parents,
    or replaced. Past the upload limit: 413 FileTooLarge."""
    _refuse_ownership(uid, gid, mode)
    data = await _read_body(request, service.admission.upload_limit())
    return _stat(await service.volumes.upload(owner, volume_id, _inside(path), data))
