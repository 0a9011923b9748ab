"""Liveness for load balancers (public, says nothing else), the service's status and Prometheus
metrics (behind a key: they count every tenant's sessions and errors)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.front_config import FrontConfig
from orchestrator.metrics import METRICS
from orchestrator.routes.deps import OwnerDep, ServiceDep, owner_of

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness: the service answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/status", summary="The caller's sessions, the backends and their warm pools")
async def status(service: ServiceDep, owner: OwnerDep) -> dict[str, object]:
    return service.views.status(owner)


async def metrics_reader(request: Request) -> None:
    """A key is needed unless the operator made the metrics public (`metrics_public`)."""
    fronts: FrontConfig = request.app.state.fronts
    if not fronts.metrics_public:
        owner_of(request)


@router.get(
    "/metrics",
    summary="Prometheus metrics (a bearer key, unless metrics_public)",
    response_class=Response,
    dependencies=[Depends(metrics_reader)],
)
async def metrics() -> Response:
    return Response(generate_latest(METRICS.registry), media_type=CONTENT_TYPE_LATEST)
