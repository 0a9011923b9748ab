"""E2B's control plane, the API its SDK calls at `E2B_API_URL`: sandboxes are our sessions.

Create, get, list, kill, set the timeout, connect. What E2B's microVMs can do and our sandboxes
cannot (pause, snapshots, forks, metrics, changing network rules while running) is refused with
a message saying so. Internet access and network rules on create become a network policy
(network.py). Bodies are read and written with the SDK's own models, so the wire format is
E2B's by construction.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from e2b.api.client.models import (
    ConnectSandboxV2,
    ListedSandbox,
    NewSandboxV2,
    SandboxDetail,
    SandboxState,
    SandboxTimeoutRequest,
)
from e2b.api.client.models import Sandbox as SandboxModel
from e2b.api.client.types import Unset
from fastapi import APIRouter, Body, Query, Response
from pydantic import ValidationError

from orchestrator.e2b_compatible.deps import ApiOwnerDep, E2BDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.network import policy_for
from orchestrator.e2b_compatible.paths import E2B_HOME
from orchestrator.e2b_compatible.sandboxes import DEFAULT_TIMEOUT_S, E2BRecord, E2BSandboxes
from orchestrator.http_errors import problems
from orchestrator.schemas import CreateSessionRequest
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError

router = APIRouter(route_class=E2BRoute, tags=["e2b"])

# The envd version our data plane answers as: octet-stream uploads (0.5.7) work; file metadata
# (0.6.2) and newer features do not, and the SDK refuses them itself below this version.
ENVD_VERSION = "0.5.7"
CLIENT_ID = "code-interpreter-runtime"
# Template names E2B's SDKs use by default: they get the service's default backend.
DEFAULT_TEMPLATES = ("code-interpreter-v1", "code-interpreter", "base")

JSONBody = Annotated[dict[str, Any], Body()]


def _backend_for(service: Service, template: str) -> tuple[str, str | None]:
    """(backend, image) for an E2B template name: a backend's name, an allowed Docker image, or
    one of E2B's default templates (the default backend)."""
    enabled = service.backend_names()
    if template in enabled:
        return template, None
    if template in DEFAULT_TEMPLATES:
        return service.settings.default_backend, None
    images = service.settings.docker_images or [service.settings.docker_image]
    if "docker" in enabled and template in images:
        return "docker", template
    offered = [*DEFAULT_TEMPLATES, *enabled, *(images if "docker" in enabled else [])]
    raise E2BError(404, f"template {template!r} not found; this server offers: {offered}")


def _refuse_unsupported(body: NewSandboxV2) -> None:
    unsupported = {
        "mcp": not isinstance(body.mcp, Unset) and body.mcp is not None,
        "volume_mounts": not isinstance(body.volume_mounts, Unset) and bool(body.volume_mounts),
        "lifecycle (auto-pause)": body.auto_pause is True,
        "iam": not isinstance(body.iam, Unset),
    }
    asked = [name for name, given in unsupported.items() if given]
    if asked:
        raise E2BError(
            400,
            f"not supported by this server: {', '.join(asked)}. Its sandboxes have no MCP "
            "gateway, volumes, pausing or workload identity.",
        )


def _timeout(service: Service, value: object) -> float:
    seconds = DEFAULT_TIMEOUT_S if isinstance(value, Unset) or value is None else value
    if not isinstance(seconds, int | float) or seconds <= 0:
        raise E2BError(400, "timeout must be a positive number of seconds")
    return float(min(seconds, service.settings.max_lifetime_s))


def _end_at(service: Service, record: E2BRecord, session: Session) -> datetime:
    s = service.settings
    lifetime_left = s.max_lifetime_s - session.age()
    if record.deadline is not None:
        left = min(record.deadline - time.time(), lifetime_left)
    else:
        left = min(s.idle_timeout_s - session.idle_for(), lifetime_left)
    return datetime.now(UTC) + timedelta(seconds=max(0.0, left))


def _created(record: E2BRecord) -> dict[str, Any]:
    model = SandboxModel(
        template_id=record.template,
        sandbox_id=record.sandbox_id,
        client_id=CLIENT_ID,
        envd_version=ENVD_VERSION,
        alias=record.template,
        envd_access_token=record.token or "",
        traffic_access_token=record.token,
        domain=None,
    )
    return model.to_dict()


def _described(service: Service, record: E2BRecord, session: Session) -> dict[str, Any]:
    """What E2B's sandbox detail and list entry both say; sizes from the session's limits."""
    limits = session.limits
    return {
        "template_id": record.template,
        "sandbox_id": record.sandbox_id,
        "client_id": CLIENT_ID,
        "started_at": record.started_at,
        "end_at": _end_at(service, record, session),
        "envd_version": ENVD_VERSION,
        "state": SandboxState.RUNNING,
        "alias": record.template,
        "metadata": record.metadata,
        "cpu_count": max(1, math.ceil(limits.cpus)),
        "memory_mb": limits.memory_mb,
        "disk_size_mb": limits.workspace_size_mb,  # the workspace
    }


def _detail(service: Service, record: E2BRecord, session: Session) -> dict[str, Any]:
    described = _described(service, record, session)
    internet = service.network_of(session).enabled
    model = SandboxDetail(**described, allow_internet_access=internet, domain=None)
    return model.to_dict()


def _listed(service: Service, record: E2BRecord, session: Session) -> dict[str, Any]:
    return ListedSandbox(**_described(service, record, session)).to_dict()


@router.post("/v2/sandboxes", status_code=201, summary="E2B: create a sandbox (a session)")
@router.post("/sandboxes", status_code=201, include_in_schema=False)
async def create(
    body: JSONBody, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    try:
        request = NewSandboxV2.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid sandbox request: {exc}") from None
    _refuse_unsupported(request)
    timeout = _timeout(service, request.timeout)
    backend, image = _backend_for(service, request.template_id)
    env = {} if isinstance(request.env_vars, Unset) else dict(request.env_vars or {})
    metadata = {} if isinstance(request.metadata, Unset) else dict(request.metadata or {})
    try:
        network = policy_for(service.settings, request.allow_internet_access, request.network)
        spec = CreateSessionRequest(backend=backend, image=image, env=env, network=network)
    except ValidationError as exc:
        raise E2BError(400, problems(exc.errors())) from None
    session = await service.create_session(owner, spec, workdir=E2B_HOME)
    record = sandboxes.add(session, template=request.template_id, metadata=metadata)
    record.set_timeout(timeout)
    return _created(record)


@router.get("/v2/sandboxes", summary="E2B: list the caller's sandboxes")
@router.get("/sandboxes", include_in_schema=False)
async def list_sandboxes(
    service: ServiceDep,
    sandboxes: E2BDep,
    owner: ApiOwnerDep,
    metadata: Annotated[str | None, Query()] = None,
    state: Annotated[str | None, Query()] = None,
) -> list[dict[str, Any]]:
    wanted = _metadata_query(metadata)
    if state is not None and "running" not in state.split(","):
        return []  # nothing here is ever paused
    out = []
    for session in sandboxes.listed(owner):
        record, _ = await _owned_or_none(sandboxes, session.id, owner)
        if record is None or any(record.metadata.get(k) != v for k, v in wanted.items()):
            continue
        out.append(_listed(service, record, session))
    return out


async def _owned_or_none(
    sandboxes: E2BSandboxes, sandbox_id: str, owner: str
) -> tuple[E2BRecord | None, Session | None]:
    try:
        return await sandboxes.owned(sandbox_id, owner)
    except SessionError:
        return None, None


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
    sandbox_id: str, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    record, session = await sandboxes.owned(sandbox_id, owner)
    return _detail(service, record, session)


@router.delete("/sandboxes/{sandbox_id}", status_code=204, summary="E2B: kill a sandbox")
async def kill(sandbox_id: str, sandboxes: E2BDep, owner: ApiOwnerDep) -> Response:
    record, _ = await sandboxes.owned(sandbox_id, owner)
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
    record, session = await sandboxes.owned(sandbox_id, owner)
    record.set_timeout(_timeout(service, request.timeout))
    service.keepalive(session)
    return Response(status_code=204)


@router.post("/v2/sandboxes/{sandbox_id}/connect", summary="E2B: connect to a sandbox")
@router.post("/sandboxes/{sandbox_id}/connect", include_in_schema=False)
@router.post("/sandboxes/{sandbox_id}/resume", include_in_schema=False)
async def connect(
    sandbox_id: str, body: JSONBody, service: ServiceDep, sandboxes: E2BDep, owner: ApiOwnerDep
) -> dict[str, Any]:
    try:
        request = ConnectSandboxV2.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise E2BError(400, f"invalid connect request: {exc}") from None
    record, session = await sandboxes.owned(sandbox_id, owner)
    if not isinstance(request.timeout, Unset):
        # Like E2B: a running sandbox's timeout is only ever extended by connecting.
        wanted = time.time() + _timeout(service, request.timeout)
        if record.deadline is not None and wanted > record.deadline:
            record.deadline = wanted
    service.keepalive(session)
    return _created(record)


# What only a microVM can do: answered 501 with what is missing, never a silent success.
_NEEDS_A_MICROVM = [
    ("POST", "/sandboxes/{sandbox_id}/pause", "pausing"),
    ("POST", "/sandboxes/{sandbox_id}/snapshots", "snapshots"),
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
