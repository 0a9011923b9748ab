"""E2B's network settings, read as one of our network policies.

E2B's words: `allow_internet_access` (false is the same as denying 0.0.0.0/0) and `network`'s
`allow_out` (CIDRs, addresses or domain names, `*.domain` included; allowed entries win over
denied ones) and `deny_out` (CIDRs or addresses). Ours: a policy the egress proxy enforces by
host name (code_interpreter_wire/network_policy.py), held by the service to the operator's ceiling.

- Internet access asked (true, or left to E2B's default of true): the operator's
  `network_internet` policy (by default its ceiling; `none` unless the operator opens it), fitted
  within the network the caller's key may have (its policy's `network` rule). So an SDK that asks
  for the internet by default is never refused for it: it gets what the operator offers this
  key, and the sandbox's detail says whether that is any internet at all.
- `deny_out` covering everything (or internet access refused) with an `allow_out`: an allow-list
  of those entries. As in E2B, a domain is matched on the web ports only (80 by Host, 443 by
  SNI there; by name through our proxy here), an address or network on every port.
- Any other `deny_out` entries (addresses or networks): deny rules, on every port, on top of
  the internet policy.
- A policy beyond the operator's ceiling is refused by the service, as on our own API.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from e2b.api.client.types import Unset

from code_interpreter_wire.network_policy import (
    DEFAULT_PORTS,
    NO_NETWORK,
    NetworkPolicy,
    PolicyError,
)
from orchestrator.e2b_compatible.errors import E2BError

_ALL_TRAFFIC = ("0.0.0.0/0", "::/0")


def _entries(value: Any, what: str) -> list[str]:
    if isinstance(value, Unset) or value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise E2BError(400, f"network.{what} must be a list of strings")
    return [v.strip() for v in value if v.strip()]


def _rules(entries: list[str]) -> list[dict[str, object]]:
    """E2B's entries as our rules: addresses and networks on every port, domains on 80 and
    443 (E2B matches a domain by an HTTP Host header or a TLS SNI only)."""
    return [
        {"host": entry, "ports": () if _is_address_or_network(entry) else DEFAULT_PORTS}
        for entry in entries
    ]


def _is_address_or_network(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def policy_for(allow_internet_access: Any, network: Any, offered: NetworkPolicy) -> NetworkPolicy:
    """Our policy for E2B's create request fields (Unset where the client sent nothing).
    `offered`: what internet access is for this caller, as the service decides it
    (`Admission.internet_for`)."""
    internet = allow_internet_access is not False  # E2B's default is true
    allow_out = _entries(getattr(network, "allow_out", None), "allow_out")
    deny_out = _entries(getattr(network, "deny_out", None), "deny_out")
    deny_all = any(entry in _ALL_TRAFFIC for entry in deny_out)
    deny_rest = [entry for entry in deny_out if entry not in _ALL_TRAFFIC]
    try:
        if allow_out and (deny_all or not internet):
            return NetworkPolicy.model_validate(
                {"allow": _rules(allow_out), "deny": _rules(deny_rest)}
            )
        if not internet or deny_all:
            return NO_NETWORK
        base = offered
        if base.mode == "none" or not deny_rest:
            return base
        denied = NetworkPolicy.model_validate({"mode": "any", "deny": _rules(deny_rest)}).deny
        return base.model_copy(update={"deny": (*base.deny, *denied)})
    except (PolicyError, ValueError) as exc:
        raise E2BError(400, f"invalid network settings: {exc}") from None
