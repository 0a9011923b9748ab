"""What the service hands its sessions' egress proxies (sandbox/egress/): its own endpoints,
which no session may reach, and the operator's private hosts, checked as the settings load."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from orchestrator.config import Settings
from orchestrator.service_endpoints import service_endpoints
from sandbox.egress.settings import ServiceEndpoint

pytestmark = pytest.mark.unit


def api_at(host: str, port: int) -> tuple[ServiceEndpoint, ...]:
    return (ServiceEndpoint("the service's own API", host, port),)


def test_the_service_hands_its_api_and_store_to_the_proxy() -> None:
    def with_store(url: str, **more: object) -> Settings:
        return Settings().model_copy(update={"store_url": SecretStr(url), **more})

    everywhere = with_store("redis://:pw@redis.internal/0", host="0.0.0.0", port=8123)
    assert service_endpoints(everywhere) == (
        ServiceEndpoint("the service's own API", "0.0.0.0", 8123),
        ServiceEndpoint("the cluster store", "redis.internal", 6379),
    )
    tls = with_store("rediss://user:pw@[fd00::5]:6390/1")
    assert service_endpoints(tls)[1:] == (ServiceEndpoint("the cluster store", "fd00::5", 6390),)
    local = with_store("unix:///run/redis.sock")
    assert service_endpoints(local) == api_at("127.0.0.1", 8000)
    # Cluster mode's Ray head, as a GCS address or a Ray Client URL; "auto" names none.
    for address, host, port in (
        ("10.0.0.7:6379", "10.0.0.7", 6379),
        ("ray://head:10001", "head", 10001),
    ):
        ray = Settings().model_copy(update={"ray_address": address})
        assert service_endpoints(ray)[1:] == (
            ServiceEndpoint("the Ray cluster's head", host, port),
        )
    assert service_endpoints(Settings().model_copy(update={"ray_address": "auto"}))[1:] == ()


def test_the_service_refuses_to_start_with_a_bad_entry() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(egress_private_hosts="good.internal:5432,bad.internal:99999")
    assert "'bad.internal:99999'" in str(caught.value)
    settings = Settings(egress_private_hosts="good.internal:5432,index.internal")
    assert settings.egress_private_hosts == ["good.internal:5432", "index.internal"]
