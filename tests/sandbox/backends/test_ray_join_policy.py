"""Whether the ray backend joins a cluster without Ray's token authentication
(sandbox/backends/ray_cluster/join_policy.py): on loopback yes; across a network only with
`RAY_AUTH_MODE=token`, or when the operator allowed it in so many words. No Ray needed."""

from __future__ import annotations

import pytest

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.backends.ray_cluster.join_policy import address_host, check_join, is_loopback

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.0.0.5:6379", "10.0.0.5"),
        ("ray://head.internal:10001", "head.internal"),
        ("[::1]:6379", "::1"),
        ("::1", "::1"),
        ("head", "head"),
    ],
)
def test_the_host_of_an_address(address: str, host: str) -> None:
    assert address_host(address) == host


@pytest.mark.parametrize(
    "address", ["127.0.0.1:6379", "127.0.0.2:1", "localhost:6379", "[::1]:6379", "auto", "local"]
)
def test_loopback_and_this_machines_cluster_need_no_token(address: str) -> None:
    assert is_loopback(address)
    check_join(address, {}, allow_unauthenticated=False)


@pytest.mark.parametrize(
    "address", ["10.0.0.5:6379", "ray-head.svc:6379", "ray://10.1.2.3:10001", "[fd00::1]:6379"]
)
def test_a_cluster_across_a_network_needs_token_auth(address: str) -> None:
    assert not is_loopback(address)
    for env in ({}, {"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": ""}):
        with pytest.raises(BackendUnavailable) as refused:
            check_join(address, env, allow_unauthenticated=False)
        message = str(refused.value)
        assert "RAY_AUTH_MODE=token" in message and "Securing the cluster" in message
        assert "docs/cluster.md" in message and "allow_unauthenticated" in message
    check_join(address, {"RAY_AUTH_MODE": "token"}, allow_unauthenticated=False)
    check_join(address, {"RAY_AUTH_MODE": "TOKEN "}, allow_unauthenticated=False)


def test_the_operator_may_allow_an_open_cluster_explicitly() -> None:
    check_join("10.0.0.5:6379", {}, allow_unauthenticated=True)
