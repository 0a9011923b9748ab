"""What no sandbox may reach whatever the operator's private hosts allow: the service's own
endpoints, read from the whole settings by the composition root (the egress section holds them)."""

from __future__ import annotations

import contextlib
from urllib.parse import urlsplit

from orchestrator.config import Settings
from sandbox.egress.settings import ServiceEndpoint


def service_endpoints(settings: Settings) -> tuple[ServiceEndpoint, ...]:
    """What the service itself listens on or depends on, which no sandbox may reach whatever
    the operator's private hosts allow: its API (a key's way in; the console's login), its
    shared store (holding every key's principal record and the audit log) and the Ray head of
    cluster mode (which drives every session's actor)."""
    endpoints = [ServiceEndpoint("the service's own API", settings.host, settings.port)]
    if settings.store_url is not None:
        url = urlsplit(settings.store_url.get_secret_value())
        with contextlib.suppress(ValueError):  # a port that is no number: no store to reach
            if url.scheme in ("redis", "rediss"):
                host = url.hostname or "localhost"
                endpoints.append(ServiceEndpoint("the cluster store", host, url.port or 6379))
    ray = _ray_endpoint(settings.ray_address)
    if ray is not None:
        endpoints.append(ray)
    return tuple(endpoints)


def _ray_endpoint(address: str | None) -> ServiceEndpoint | None:
    """The Ray cluster's head (its GCS, or Ray Client's `ray://` port): a session's actor is
    driven through it. None when unset, `auto`, or not an address."""
    if not address or address == "auto":
        return None
    url = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        port = url.port
    except ValueError:
        return None
    if url.hostname is None or port is None:
        return None
    return ServiceEndpoint("the Ray cluster's head", url.hostname, port)
