"""Deny rules by address (`deny_out` in E2B's words) against a name whose DNS answer spells a
denied IPv4 address in IPv6 form (`::ffff:a.b.c.d`, an AAAA record anyone with a domain can
publish): the proxy dials it over a dual-stack socket and reaches the very IPv4 address."""

from __future__ import annotations

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.egress.decision import denied_address
from tests.sandbox.egress.conftest import HELLO, StartProxy, UpstreamServer, raw_exchange

DENY_LOOPBACK = NetworkPolicy.model_validate({"mode": "any", "deny": ["127.0.0.0/8:*"]})


def test_a_denied_network_is_denied_in_its_ipv4_mapped_form() -> None:
    for spelled in ("127.0.0.1", "::ffff:127.0.0.1", "::ffff:7f00:1"):
        refusal = denied_address(DENY_LOOPBACK, NetworkPolicy(mode="any"), "x.test", spelled, 80)
        assert refusal is not None and not refusal.allowed, spelled


async def test_a_name_answering_the_mapped_form_of_a_denied_address_is_refused(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    """Loopback stands in for a public address here (private_hosts lets the name reach it, so
    only the deny rule stands in the way, as it would for a public one)."""
    running = await start_proxy(
        DENY_LOOPBACK,
        resolve_overrides={"mapped.test": ("::ffff:127.0.0.1",), "plain.test": ("127.0.0.1",)},
        private_hosts=frozenset({f"mapped.test:{upstream.port}", f"plain.test:{upstream.port}"}),
    )
    for name in ("plain.test", "mapped.test"):
        authority = f"{name}:{upstream.port}"
        request = f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        answer = await raw_exchange(
            running.relay_port,
            request.encode(),
        )
        assert answer.startswith(b"HTTP/1.1 403"), (name, answer[:300])
        assert HELLO not in answer, name
