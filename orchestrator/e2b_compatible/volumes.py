"""E2B's volumes on ours (docs/volumes.md): its control plane (`Volume.create`, `list`,
`get_info`, `destroy`, called with the API key) and `volumeMounts` on create.

E2B names a volume by id or by name (its SDK mounts by name), so names made here are unique per
key (checked under the key's lock every replica takes); a name two of a key's volumes share
(made through `/v1/volumes`, where names are free) is refused as ambiguous rather than guessed.
E2B's mounts are read-write; its SDK has no read-only flag. The volume token E2B gives with a
volume opens that volume's files (volume_content.py) and nothing else, for TOKEN_TTL_S after it
was given, and only while the key it was given to works (neither revoked nor gone from the
settings): an HMAC of the owner, the volume and the time under a secret kept beside the volumes,
so every replica sharing the volumes directory knows it and it survives restarts. E2B's SDK
keeps a Volume object's token for the object's life and never asks for another: an object kept
past a day is made again with `Volume.connect`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Protocol

from e2b.api.client.models import NewVolume, SandboxVolumeMount, VolumeAndToken
from e2b.api.client.models import Volume as VolumeModel
from e2b.api.client.types import Unset
from fastapi import APIRouter, Body, Response
from pydantic import ValidationError

from code_interpreter_wire.volumes import CreateVolumeRequest, VolumeMount
from orchestrator.e2b_compatible.deps import ApiOwnerDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BNamedRoute
from orchestrator.http_errors import problems
from orchestrator.service import Service
from orchestrator.service_parts.volumes import VolumeNameTaken, VolumeNotFound
from orchestrator.sessions import SessionError
from orchestrator.volumes.store import VolumeRecord

# Our refusals with their type in the message (`VolumeInUse: ...`): E2B's body has no field.
router = APIRouter(route_class=E2BNamedRoute, tags=["e2b"])
JSONBody = Annotated[dict[str, Any], Body()]

TOKEN_PREFIX = "e2bvol_"
# E2B's SDK keeps the token a Volume object was made with for the object's life (Volume.create,
# Volume.connect); one kept past this is refused, and Volume.connect gives a new one.
TOKEN_TTL_S = 24 * 3600
_CLOCK_SKEW_S = 300  # a token from a replica whose clock is ahead by up to this is good
_SECRET_FILE = ".e2b-volume-token-key"  # in the volumes directory (never a volume's name)
_KEY_BYTES = 32
_keys: dict[Path, bytes] = {}  # by volumes directory: read as the front starts


class _Named(Protocol):
    """What E2B is told of a volume: a VolumeInfo or a VolumeRecord."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...


# --- volume tokens
class TokenRefused(Exception):
    """A volume token that opens nothing here; `guessed`: not one this service signed."""

    def __init__(self, message: str, *, guessed: bool) -> None:
        super().__init__(message)
        self.guessed = guessed


def _read_or_make_key(volumes_dir: Path) -> bytes:
    """The key volume tokens are signed with, made by whichever replica comes first (blocking):
    written whole and synced under a name of its own, then linked into place, so no replica
    ever reads a part of it. A key there but damaged stops the start."""
    volumes_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    final = volumes_dir / _SECRET_FILE
    if not final.exists():
        partial = volumes_dir / f".{_SECRET_FILE}.{secrets.token_hex(6)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(partial, flags, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(_KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another replica's came first: its
                os.link(partial, final)  # atomic, and never over another replica's
        finally:
            partial.unlink(missing_ok=True)
        dir_fd = os.open(volumes_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # the link lasts past a crash
        finally:
            os.close(dir_fd)
    with open(final, "rb") as f:
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise RuntimeError(
            f"{final} is damaged ({len(key)} bytes, not {_KEY_BYTES}): remove it and start "
            "again (every replica sharing the volumes directory; volume tokens given so far end)"
        )
    return key


async def load_token_key(service: Service) -> None:
    """Read (or make) the volume tokens' key: once, as the front starts, off the event loop.
    A key replaced while the service runs is taken at its next start (every replica's)."""
    volumes_dir = service.volumes.settings.volumes_dir
    _keys[volumes_dir] = await asyncio.to_thread(_read_or_make_key, volumes_dir)


def _key_of(service: Service) -> bytes:
    try:
        return _keys[service.volumes.settings.volumes_dir]
    except KeyError:
        raise RuntimeError("the E2B front has not started: no volume token key read") from None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _mac(key: bytes, owner: str, volume_id: str, issued: int) -> str:
    message = f"e2b-volume/2\0{owner}\0{volume_id}\0{issued}".encode()
    return _b64(hmac.new(key, message, hashlib.sha256).digest())


def sign_token(key: bytes, owner: str, volume_id: str, issued: int) -> str:
    """A volume token: the owner, when it was given, and the MAC of both with the volume."""
    mac = _mac(key, owner, volume_id, issued)
    return f"{TOKEN_PREFIX}{_b64(owner.encode())}.{issued}.{mac}"


def check_token(key: bytes, token: str, volume_id: str, now: float) -> str:
    """The owner a volume token was given to, if it is this volume's and not expired; else
    TokenRefused."""
    wrong = TokenRefused(f"this volume token does not open volume {volume_id!r}", guessed=True)
    if not token.startswith(TOKEN_PREFIX) or len(token) > 1024:
        raise wrong
    parts = token[len(TOKEN_PREFIX) :].split(".")
    if len(parts) != 3:  # (the first tokens, without a time, were never to expire: refused)
        raise wrong
    named, issued_text, mac = parts
    try:
        owner = base64.urlsafe_b64decode(named + "=" * (-len(named) % 4)).decode()
        issued = int(issued_text) if issued_text.isdigit() and len(issued_text) < 16 else -1
    except ValueError:
        raise wrong from None
    expected = _mac(key, owner, volume_id, issued)
    if issued < 0 or not hmac.compare_digest(expected.encode(), mac.encode()):
        raise wrong
    if issued - _CLOCK_SKEW_S > now:
        raise TokenRefused("this volume token is from the future: check the clocks", guessed=False)
    if now >= issued + TOKEN_TTL_S:
        raise TokenRefused(
            f"this volume token expired (they last {TOKEN_TTL_S // 3600} h): get a new one "
            "with Volume.connect or Volume.get_info",
            guessed=False,
        )
    return owner


def token_for(service: Service, owner: str, volume_id: str) -> str:
    """A token for the volume's owner, good for TOKEN_TTL_S from now."""
    return sign_token(_key_of(service), owner, volume_id, int(time.time()))


def owner_of_token(service: Service, token: str, volume_id: str) -> str:
    """The owner a volume token was given to, if it is this volume's and still good; else
    TokenRefused. Whether that owner's key still works is the caller's to ask."""
    return check_token(_key_of(service), token, volume_id, time.time())


# --- finding a volume by id or name
async def find(service: Service, owner: str, id_or_name: str) -> VolumeRecord:
    """The key's volume with this id, else with this name (E2B's SDK uses both): as kept, its
    usage not counted nor its holders read."""
    try:
        return await service.volumes.record(owner, id_or_name)
    except VolumeNotFound:
        pass
    named = [v for v in await service.volumes.records(owner) if v.name == id_or_name]
    if len(named) > 1:
        ids = ", ".join(v.id for v in named)
        raise E2BError(
            409,
            f"VolumeAmbiguous: {len(named)} of your volumes are named "
            f"{id_or_name!r} ({ids}): name one by its id",
        )
    if not named:
        raise E2BError(404, f"VolumeNotFound: no volume {id_or_name!r} of yours")
    return named[0]


async def mounts_for(
    service: Service, owner: str, asked: Sequence[SandboxVolumeMount] | Unset | None
) -> list[VolumeMount]:
    """E2B's `volumeMounts` ({name, path}, read-write) as our mounts; an unknown volume: 404."""
    if isinstance(asked, Unset) or not asked:
        return []
    found = []
    for mount in asked:
        volume = await find(service, owner, mount.name)
        try:
            found.append(VolumeMount(volume_id=volume.id, path=mount.path))
        except ValidationError as exc:
            raise E2BError(400, f"volume mount {mount.path!r}: {problems(exc.errors())}") from None
    return found


async def mounts_shown(
    service: Service, owner: str, mounts: Sequence[VolumeMount]
) -> list[SandboxVolumeMount]:
    """What a sandbox's detail says it mounts: each volume's name (as E2B's SDK sent it)."""
    shown = []
    for mount in mounts:
        try:
            name = (await service.volumes.record(owner, mount.volume_id)).name
        except SessionError:
            name = mount.volume_id
        shown.append(SandboxVolumeMount(name=name, path=mount.path))
    return shown


def _with_token(service: Service, owner: str, volume: _Named) -> dict[str, Any]:
    token = token_for(service, owner, volume.id)
    return VolumeAndToken(volume_id=volume.id, name=volume.name, token=token).to_dict()


# --- the routes
@router.post("/volumes", status_code=201, summary="E2B: create a volume")
async def create(body: JSONBody, service: ServiceDep, owner: ApiOwnerDep) -> dict[str, Any]:
    """A volume of the service's default size; its name must be free among the key's."""
    try:
        asked = NewVolume.from_dict(body)
        request = CreateVolumeRequest(name=asked.name)
    except (KeyError, TypeError, ValueError) as exc:
        message = problems(exc.errors()) if isinstance(exc, ValidationError) else str(exc)
        raise E2BError(400, f"invalid volume request: {message}") from None
    try:
        volume = await service.volumes.create(owner, request, unique_name=True)
    except VolumeNameTaken:  # (E2B's word for it)
        raise E2BError(
            409, f"VolumeExists: you have a volume named {request.name!r}: pick another name"
        ) from None
    return _with_token(service, owner, volume)


@router.get("/volumes", summary="E2B: list the caller's volumes")
async def list_volumes(service: ServiceDep, owner: ApiOwnerDep) -> list[dict[str, Any]]:
    """Ids and names only (E2B's list carries no more): as kept, no usage counted."""
    volumes = await service.volumes.records(owner)
    return [VolumeModel(volume_id=v.id, name=v.name).to_dict() for v in volumes]


@router.get("/volumes/{volume}", summary="E2B: get a volume (by id or name), with its token")
async def get(volume: str, service: ServiceDep, owner: ApiOwnerDep) -> dict[str, Any]:
    return _with_token(service, owner, await find(service, owner, volume))


@router.delete("/volumes/{volume}", status_code=204, summary="E2B: destroy a volume")
async def destroy(volume: str, service: ServiceDep, owner: ApiOwnerDep) -> Response:
    """409 while a sandbox (running or paused) mounts it; another key's is not found."""
    found = await find(service, owner, volume)
    await service.volumes.delete(owner, found.id)
    return Response(status_code=204)
