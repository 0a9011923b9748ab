"""Whether a destination may be reached: the session's policy AND the deployment's ceiling, with
two rules of the proxy's own on top (numeric names, IP literals)."""

from __future__ import annotations

import ipaddress

from code_interpreter_wire.network_policy import (
    Decision,
    IpAddress,
    NetworkPolicy,
    address_of,
    is_numeric_name,
)
from sandbox.egress.address_guard import forms_of


def decide(policy: NetworkPolicy, ceiling: NetworkPolicy, host: str, port: int) -> Decision:
    """The answer for a normalized host and a port; a refusal's reason is a sentence the
    sandboxed code will read."""
    literal = address_of(host) is not None
    if not literal and is_numeric_name(host):
        return Decision(
            False,
            f"{host} is a number, not a host name (resolvers may read it as an address); "
            "use the host's name",
        )
    answer = policy.decide(host, port)
    if not answer.allowed:
        return answer
    if literal and not any(
        rule.pattern.network is not None and rule.matches(host, port) for rule in policy.allow
    ):
        return Decision(
            False,
            f"{host} is an IP address; addresses are reached only through an address rule "
            "of the policy (e.g. 203.0.113.7 or 203.0.113.0/24), not through names or 'any'",
        )
    limit = ceiling.decide(host, port)
    if not limit.allowed:
        return Decision(False, f"beyond this deployment's ceiling: {limit.reason}")
    return answer


def denied_address(
    policy: NetworkPolicy,
    ceiling: NetworkPolicy,
    host: str,
    address: IpAddress | str,
    port: int,
) -> Decision | None:
    """The refusal of a resolved address that an address deny rule (of the policy or the
    ceiling: `10.0.0.0/8`, as E2B's `deny_out` writes them) covers, in any of its forms (an
    IPv4-mapped or translated IPv6 answer included), or None. Deny rules by address must hold
    for names too, or any name pointing into a denied network would pass."""
    if isinstance(address, str):
        address = ipaddress.ip_address(address)
    for owner, rules in (("the policy", policy.deny), ("the ceiling", ceiling.deny)):
        for rule in rules:
            if rule.pattern.network is None:
                continue
            for form in forms_of(address):
                if rule.matches(str(form), port):
                    return Decision(
                        False,
                        f"{host} resolves to {address}, which {owner}'s deny rule {rule} covers",
                    )
    return None
