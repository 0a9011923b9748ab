"""Health and metrics, for load balancers and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.metrics import METRICS
from orchestrator.routes.deps import ServiceDep

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness and what the service holds")
async def healthz(service: ServiceDep) -> dict[str, object]:
    return {
        "status": "ok",
        "sessions": service.sessions.count,
        "backends": list(service.sessions.backends),
        "pools": {name: pool.ready for name, pool in service.sessions.pools.items()},
    }


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics() -> Response:
    return Response(generate_latest(METRICS.registry), media_type=CONTENT_TYPE_LATEST)
