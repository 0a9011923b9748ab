"""E2B's control plane, the API its SDK calls at `E2B_API_URL`: sandboxes are our sessions.

Create, get, list, kill, set the timeout, connect, pause (and resume by connecting), lifecycle
auto-pause, snapshots (and sandboxes made from them, the snapshot id given as the template),
volume mounts (volumes.py). What E2B's microVMs can do and our sandboxes cannot (forks, metrics,
a filesystem-only pause, a cold boot on resume, changing network rules while running) is refused
with a message saying so.
Internet access and network rules on create become a network policy (network.py). Bodies are
read and written with the SDK's own models, so the wire format is E2B's by construction.
"""

from __future__ import annotations

import math
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, unquote

from e2b.api.client.models import (
    ConnectSandboxV2,
    ListedSandbox,
    NewSandboxV2,
    SandboxDetail,
    SandboxLifecycle,
    SandboxOnTimeout,
    SandboxPauseMode,
    SandboxPauseRequest,
    SandboxSnapshotRequest,
    SandboxState,
    SandboxTimeoutRequest,
    SandboxVolumeMount,
    SnapshotInfo,
)
from e2b.api.client.models import Sandbox as SandboxModel
from e2b.api.client.types import Unset
from fastapi import APIRouter, Body, Query, Request, Response
from pydantic import ValidationError

from code_interpreter_wire.ports import PortAccess, PortsRequest
from code_interpreter_wire.rest import CreateSessionRequest, SessionInfo
from orchestrator.e2b_compatible.deps import ApiOwnerDep, E2BDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.network import policy_for
from orchestrator.e2b_compatible.paths import E2B_HOME
from orchestrator.e2b_compatible.sandboxes import (
    DEFAULT_TIMEOUT_S,
    E2BRecord,
)
from orchestrator.e2b_compatible.volumes import mounts_for, mounts_shown
from orchestrator.http_errors import problems
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionBusy, SessionError

router = APIRouter(route_class=E2BRoute, tags=["e2b"])

# The envd version our data plane answers as: octet-stream uploads (0.5.7) work; file metadata
# (0.6.2) and newer features do not, and the SDK refuses them itself below this version.
ENVD_VERSION = "0.5.7"
CLIENT_ID = "code-interpreter-runtime"
# Template names E2B's SDKs use by default: they get the service's default backend (or, for a
# key whose policy excludes it, the first backend the policy allows: the service fits it).
DEFAULT_TEMPLATES = ("code-interpreter-v1", "code-interpreter", "base")

JSONBody = Annotated[dict[str, Any], Body()]
# Our snapshots' ids: what a template name that starts a sandbox from a snapshot looks like.
SNAPSHOT_PREFIX = "snap-"
MAX_PAGE = 100  # E2B's largest and default page of a list


async def _backend_for(service: Service, template: str) -> tuple[str | None, str | None]:
    """(backend, image) for an E2B template name: a backend's name, an allowed Docker image, a
    template built here (`code-interpreter template build`), or one of E2B's default templates
    (no backend named: the service picks it, within the key's policy)."""
    enabled = service.views.backend_names()
    if template in enabled:
        return template, None
    if template in DEFAULT_TEMPLATES:
        return None, None
    images = service.views.listed_images()
    runs_images = service.views.image_backend()
    if runs_images is not None and template in images:
        return runs_images, template
    built = await service.views.templates()
    if runs_images is not None and template in built:
        return runs_images, built[template]
    offered = [
        *DEFAULT_TEMPLATES,
        *enabled,
        *(images if runs_images is not None else []),
        *built,
    ]
    raise E2BError(404, f"template {template!r} not found; this server offers: {offered}")


def _refuse_unsupported(body: NewSandboxV2) -> None:
    unsupported = {
        "mcp": not isinstance(body.mcp, Unset) and body.mcp is not None,
        "iam": not isinstance(body.iam, Unset),
    }
    asked = [name for name, given in unsupported.items() if given]
    if asked:
        raise E2BError(
            400,
            f"not supported by this server: {', '.join(asked)}. Its sandboxes have no MCP "
            "gateway or workload identity.",
        )
    if body.auto_pause is True and body.auto_pause_memory is False:
        raise E2BError(
            400,
            "lifecycle on_timeout mode 'filesystem' is not supported by this server: its pause "
            "always keeps the sandbox's variables with its files; leave the mode out (or 'full')",
        )


def _lifecycle(body: NewSandboxV2) -> tuple[bool, bool]:
    """(auto_pause, auto_resume) a create asks for; E2B's defaults when absent."""
    auto_pause = body.auto_pause is True
    auto_resume = not isinstance(body.auto_resume, Unset) and body.auto_resume.enabled
    if auto_resume and not auto_pause:
        raise E2BError(400, "lifecycle auto_resume needs on_timeout 'pause'")
    return auto_pause, auto_resume


def _timeout(service: Service, value: object) -> float:
    seconds = DEFAULT_TIMEOUT_S if isinstance(value, Unset) or value is None else value
    if not isinstance(seconds, int | float) or seconds <= 0:
        raise E2BError(400, "timeout must be a positive number of seconds")
    return service.lifecycle.within_lifetime(seconds)


def _end_at(record: E2BRecord, info: SessionInfo) -> datetime:
    """When it ends: a running one at its timeout (or the service's expiry); a paused one when
    the service's retention of paused sessions deletes it."""
    if info.state == "paused":
        left = info.deleted_in_s or 0.0
    elif record.deadline is not None:
        left = min(record.deadline - time.time(), info.lifetime_expires_in_s)
    else:
        left = min(info.idle_expires_in_s, info.lifetime_expires_in_s)
    return datetime.now(UTC) + timedelta(seconds=max(0.0, left))


def _created(record: E2BRecord, ports: PortAccess | None, domain: str) -> dict[str, Any]:
    """What a create or connect answers: the sandbox's tokens, and the domain its
    `get_host(port)` hosts are under (`<port>-<id>.<domain>`, routed to its ports)."""
    model = SandboxModel(
        template_id=record.template,
        sandbox_id=record.sandbox_id,
        client_id=CLIENT_ID,
        envd_version=ENVD_VERSION,
        alias=record.template,
        envd_access_token=record.token or "",
        # Its ports' token, which is its access token (one secret, as on E2B): what E2B's SDK
        # sends to the code interpreter's contexts, and to a port whose traffic is not public.
        traffic_access_token=ports.token if ports is not None else None,
        domain=domain,
    )
    return model.to_dict()


def _ports_domain(service: Service, request: Request) -> str:
    """The domain of the sandbox's hosts (`<port>-<id>.<domain>`: its ports, and envd's for an
    SDK told no sandbox URL): the operator's `ports_domain`; else the one the SDK called the
    API under (E2B's API is `api.<domain>`), or the host it called (`localhost:8000` gives
    `8000-<id>.localhost:8000`, which browsers take to loopback)."""
    if service.ports.settings.ports_domain:
        return service.ports.settings.ports_domain
    host = request.headers.get("host") or "localhost"
    return host[4:] if host.lower().startswith("api.") else host


async def _ports_of(service: Service, record: E2BRecord) -> PortAccess | None:
    found = await service.lifecycle.state(record.session_id, record.owner)
    return found.ports if found is not None else None


def _ports_asked(service: Service, network: Any) -> PortsRequest:
    """E2B's sandboxes serve their ports (public unless `allow_public_traffic` is false, or
    the operator's default says otherwise); `mask_request_host` is the Host servers get."""
    public = getattr(network, "allow_public_traffic", None)
    if isinstance(public, Unset) or public is None:
        public = service.ports.public_by_default
    elif public and not service.ports.public_by_default:
        raise E2BError(
            403,
            "public sandbox traffic is off on this server (ports_public): create the sandbox "
            "with network allow_public_traffic false and send its traffic access token",
        )
    mask = getattr(network, "mask_request_host", None)
    return PortsRequest(
        public=bool(public), host_header=None if isinstance(mask, Unset) or not mask else mask
    )


def _described(record: E2BRecord, info: SessionInfo) -> dict[str, Any]:
    """What E2B's sandbox detail and list entry both say, running or paused; sizes from the
    session's limits."""
    limits = info.limits
    return {
        "template_id": record.template,
        "sandbox_id": record.sandbox_id,
        "client_id": CLIENT_ID,
        "started_at": record.started_at,
        "end_at": _end_at(record, info),
        "envd_version": ENVD_VERSION,
        "state": SandboxState(info.state),
        "alias": record.template,
        "metadata": record.metadata,
        "cpu_count": max(1, math.ceil(limits.cpus)),
        "memory_mb": limits.memory_mb,
        "disk_size_mb": limits.workspace_size_mb,  # the workspace
    }


def _detail(
    record: E2BRecord, info: SessionInfo, domain: str, mounts: list[SandboxVolumeMount]
) -> dict[str, Any]:
    lifecycle = SandboxLifecycle(
        auto_resume=record.auto_resume,
        on_timeout=SandboxOnTimeout.PAUSE if record.auto_pause else SandboxOnTimeout.KILL,
    )
    model = SandboxDetail(
        **_described(record, info),
        allow_internet_access=info.network.enabled,
        domain=domain,
        lifecycle=lifecycle,
        volume_mounts=mounts,
    )
    if info.state == "paused":  # what a pause here keeps: memory (variables) and files
        model.pause_mode = SandboxPauseMode.FULL
    return model.to_dict()


def _listed(
    record: E2BRecord, info: SessionInfo, mounts: list[SandboxVolumeMount]
) -> dict[str, Any]:
    return ListedSandbox(**_described(record, info), volume_mounts=mounts).to_dict()


async def _info(service: Service, record: E2BRecord) -> SessionInfo:
    return await service.lifecycle.describe(record.session_id, record.owner)


@router.post("/v2/sandboxes", status_code=201, summary="E2B: create a sandbox (a session)")
@router.post("/sandboxes", status_code=201, include_in_schema=False)
async def create(
    body: JSONBody, http: Request, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    try:
        request = NewSandboxV2.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid sandbox request: {exc}") from None
    _refuse_unsupported(request)
    auto_pause, auto_resume = _lifecycle(request)
    timeout = _timeout(service, request.timeout)
    from_snapshot = request.template_id.startswith(SNAPSHOT_PREFIX)
    # A snapshot's own backend and image (the service takes them from it); else the template's.
    backend, image = (
        (None, None) if from_snapshot else await _backend_for(service, request.template_id)
    )
    volumes = await mounts_for(service, owner, request.volume_mounts)
    env = {} if isinstance(request.env_vars, Unset) else dict(request.env_vars or {})
    metadata = {} if isinstance(request.metadata, Unset) else dict(request.metadata or {})
    try:
        # "The internet" is what the operator offers, within what the key may have: an SDK's
        # default asks for it, and must not be refused for a key held to less.
        internet = service.admission.internet_for(owner)
        network = policy_for(request.allow_internet_access, request.network, internet)
        spec = CreateSessionRequest(
            backend=backend,
            image=image,
            env=env,
            network=network,
            snapshot_id=request.template_id if from_snapshot else None,
            ports=_ports_asked(service, request.network),
            volumes=volumes,
        )
    except ValidationError as exc:
        raise E2BError(400, problems(exc.errors())) from None
    token = secrets.token_urlsafe(32)  # its access token, and its ports' (its traffic token)
    session = await service.lifecycle.create(
        owner, spec, workdir=E2B_HOME, ports_if_offered=True, ports_token=token
    )
    record = sandboxes.add(
        session,
        template=request.template_id,
        metadata=metadata,
        auto_pause=auto_pause,
        auto_resume=auto_resume,
        # E2B's v1 SDK creates `secure: false` sandboxes and its code interpreter sends them
        # no token: where the operator honours that, their code port takes their public
        # traffic, as E2B's did (docs/e2b.md).
        open_code_port=(
            http.app.state.fronts.e2b_honor_insecure
            and isinstance(body, dict)
            and body.get("secure") is False
        ),
        token=token,
    )
    record.volumes = volumes
    record.set_timeout(timeout)
    await sandboxes.keep(record, session)
    return _created(record, session.ports, _ports_domain(service, http))


@router.get("/v2/sandboxes", summary="E2B: list the caller's sandboxes")
@router.get("/sandboxes", include_in_schema=False)
async def list_sandboxes(
    response: Response,
    service: ServiceDep,
    sandboxes: E2BDep,
    owner: ApiOwnerDep,
    metadata: Annotated[str | None, Query()] = None,
    state: Annotated[str | None, Query()] = None,
    template: Annotated[str | None, Query()] = None,
    started_after: Annotated[datetime | None, Query(alias="startedAfter")] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> list[dict[str, Any]]:
    """Running and paused ones (those `state` names), newest first unless `order` says; a page
    at a time, `X-Next-Token` naming the next."""
    wanted = _metadata_query(metadata)
    if started_after is not None and started_after.tzinfo is None:
        raise E2BError(400, "startedAfter needs a UTC offset (e.g. 2025-01-01T00:00:00Z or +02:00)")
    states = set(state.split(",")) if state else {"running", "paused"}
    if unknown := states - {"running", "paused"}:
        raise E2BError(400, f"unknown sandbox state {sorted(unknown)}: use running, paused")
    out = []
    for sandbox_id in await sandboxes.listed(owner):
        try:
            record, _ = await sandboxes.found(sandbox_id, owner)
            info = await _info(service, record)
        except SessionError:
            continue  # ended meanwhile
        if (
            info.state not in states
            or any(record.metadata.get(k) != v for k, v in wanted.items())
            or (template is not None and record.template != template)
            or (started_after is not None and record.started_at <= started_after)
        ):
            continue
        mounts = await mounts_shown(service, owner, record.volumes)
        out.append((record.started_at, record.sandbox_id, _listed(record, info, mounts)))
    out.sort(key=lambda x: (x[0], x[1]), reverse=order == "desc")
    start = _page_start(next_token)
    if start + limit < len(out):
        response.headers["X-Next-Token"] = str(start + limit)
    return [entry for _, _, entry in out[start : start + limit]]


def _page_start(next_token: str | None) -> int:
    """Where a page starts: our next-page tokens are offsets."""
    if not next_token:
        return 0
    if not next_token.isdigit() or len(next_token) > 9:
        raise E2BError(400, "invalid nextToken: pass the X-Next-Token of the previous page")
    return int(next_token)


def _metadata_query(metadata: str | None) -> dict[str, str]:
    """The SDK sends metadata filters as a doubly URL-encoded query string."""
    if not metadata:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(metadata, keep_blank_values=True)}


_UNSUPPORTED = (
    "is not supported by this server: its sandboxes are sessions of a local or Docker kernel, "
    "not microVMs (see docs/e2b.md)"
)


@router.get("/sandboxes/metrics", include_in_schema=False)
async def all_metrics(owner: ApiOwnerDep) -> None:
    raise E2BError(501, f"sandbox metrics {_UNSUPPORTED}")


@router.get("/sandboxes/{sandbox_id}", summary="E2B: get a sandbox")
async def get(
    sandbox_id: str, http: Request, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    record, _ = await sandboxes.found(sandbox_id, owner)
    mounts = await mounts_shown(service, owner, record.volumes)
    return _detail(record, await _info(service, record), _ports_domain(service, http), mounts)


@router.delete("/sandboxes/{sandbox_id}", status_code=204, summary="E2B: kill a sandbox")
async def kill(sandbox_id: str, sandboxes: E2BDep, owner: ApiOwnerDep) -> Response:
    record, _ = await sandboxes.found(sandbox_id, owner)  # running or paused
    await sandboxes.kill(record)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204, summary="E2B: set the timeout")
async def set_timeout(
    sandbox_id: str, body: JSONBody, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> Response:
    try:
        request = SandboxTimeoutRequest.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid timeout request: {exc}") from None
    record, session = await sandboxes.owned(sandbox_id, owner)  # a paused one: 409, say why
    record.set_timeout(_timeout(service, request.timeout))
    await sandboxes.keep(record, session)
    await service.lifecycle.keepalive(session)
    return Response(status_code=204)


@router.post("/v2/sandboxes/{sandbox_id}/connect", summary="E2B: connect to a sandbox")
@router.post("/sandboxes/{sandbox_id}/connect", include_in_schema=False)
@router.post("/sandboxes/{sandbox_id}/resume", include_in_schema=False)
async def connect(
    sandbox_id: str,
    body: JSONBody,
    http: Request,
    response: Response,
    service: ServiceDep,
    sandboxes: E2BDep,
    owner: ApiOwnerDep,
) -> dict[str, Any]:
    """200 with a running sandbox; 201 when it was paused and is resumed now, with its
    variables and files, and its timeout armed again (E2B's default 300 s if none given)."""
    try:
        request = ConnectSandboxV2.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid connect request: {exc}") from None
    record, found = await sandboxes.found(sandbox_id, owner)
    if record.pausing:  # not "running": it is paused a moment from now
        raise E2BError(409, f"sandbox {sandbox_id} is being paused: connect again once it is")
    if not isinstance(found, Session):
        if request.memory is False:
            raise E2BError(
                400,
                "on_resume='reboot' is not supported by this server: a resume here always "
                "restores the sandbox's variables and files; connect without it",
            )
        await sandboxes.resume(record, _timeout(service, request.timeout))
        response.status_code = 201
        return _created(record, await _ports_of(service, record), _ports_domain(service, http))
    if not isinstance(request.timeout, Unset):
        # Like E2B: a running sandbox's timeout is only ever extended by connecting.
        wanted = time.time() + _timeout(service, request.timeout)
        if record.deadline is not None and wanted > record.deadline:
            record.deadline = wanted
            await sandboxes.keep(record, found)
    await service.lifecycle.keepalive(found)
    response.status_code = 200
    return _created(record, found.ports, _ports_domain(service, http))


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204, summary="E2B: pause a sandbox")
async def pause(sandbox_id: str, body: JSONBody, sandboxes: E2BDep, owner: ApiOwnerDep) -> Response:
    """Its variables and files are saved and its sandboxes stopped (its contexts' too); 409 if
    it is paused already. Connecting resumes it."""
    try:
        request = SandboxPauseRequest.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid pause request: {exc}") from None
    if request.memory is False:
        raise E2BError(
            400,
            "a filesystem-only pause (mode='filesystem') is not supported by this server: its "
            "pause always keeps the variables with the files; leave the mode out",
        )
    # requireHealthyGuest: a pause here always needs the kernel's answer (it saves its
    # variables); when it cannot have it, the pause fails and the sandbox runs on.
    record, found = await sandboxes.found(sandbox_id, owner)
    if not isinstance(found, Session):
        raise E2BError(409, f"sandbox {sandbox_id} is already paused")
    try:
        await sandboxes.pause(record, found)
    except SessionBusy as exc:  # not E2B's 409, which its SDK reads as "already paused"
        raise E2BError(503, str(exc)) from None
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/snapshots", status_code=201, summary="E2B: snapshot a sandbox"
)
async def create_snapshot(
    sandbox_id: str, body: JSONBody, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    """Its default context's variables and files, saved to start new sandboxes from (the
    snapshot id as the template); the sandbox runs on (a paused one is woken for it)."""
    try:
        request = SandboxSnapshotRequest.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid snapshot request: {exc}") from None
    if request.memory is False:
        raise E2BError(
            400,
            "a filesystem-only snapshot (mode='filesystem') is not supported by this server: "
            "its snapshots always keep the variables with the files; leave the mode out",
        )
    name = None if isinstance(request.name, Unset) or not request.name else request.name
    record, _ = await sandboxes.found(sandbox_id, owner)
    session = await service.lifecycle.get(record.session_id, owner)
    taken = await service.persistence.snapshot(session, name)
    return _snapshot(taken.id, taken.name)


def _snapshot(snapshot_id: str, name: str | None) -> dict[str, Any]:
    return SnapshotInfo(snapshot_id=snapshot_id, names=[name] if name else []).to_dict()


@router.get("/snapshots", summary="E2B: list the caller's snapshots")
async def list_snapshots(
    response: Response,
    service: ServiceDep,
    owner: ApiOwnerDep,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> list[dict[str, Any]]:
    found = [
        s
        for s in await service.persistence.list_snapshots(owner)
        if (sandbox_id is None or s.session_id == sandbox_id) and (name is None or s.name == name)
    ]
    start = _page_start(next_token)
    if start + limit < len(found):
        response.headers["X-Next-Token"] = str(start + limit)
    return [_snapshot(s.id, s.name) for s in found[start : start + limit]]


@router.delete("/templates/{template_id:path}", status_code=204, summary="E2B: delete a snapshot")
async def delete_snapshot(template_id: str, service: ServiceDep, owner: ApiOwnerDep) -> Response:
    """Only snapshots are templates that can be deleted here; another key's is not found."""
    if not template_id.startswith(SNAPSHOT_PREFIX):
        raise E2BError(404, f"snapshot {template_id} not found")
    await service.persistence.delete_snapshot(owner, template_id)
    return Response(status_code=204)


# What only a microVM can do: answered 501 with what is missing, never a silent success.
_NEEDS_A_MICROVM = [
    ("POST", "/sandboxes/{sandbox_id}/fork", "forking"),
    ("GET", "/sandboxes/{sandbox_id}/metrics", "sandbox metrics"),
    ("PUT", "/sandboxes/{sandbox_id}/network", "changing network rules of a running sandbox"),
    ("GET", "/sandboxes/{sandbox_id}/logs", "sandbox logs"),
    ("GET", "/v2/sandboxes/{sandbox_id}/logs", "sandbox logs"),
]


def _unsupported(what: str) -> Any:
    async def refuse(sandbox_id: str, owner: ApiOwnerDep) -> None:
        raise E2BError(501, f"{what} {_UNSUPPORTED}")

    return refuse


for _method, _path, _what in _NEEDS_A_MICROVM:
    router.add_api_route(_path, _unsupported(_what), methods=[_method], include_in_schema=False)
