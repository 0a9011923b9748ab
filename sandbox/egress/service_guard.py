"""The service's own listeners (its API, its store), refused on every address that leads to
them: checked on each resolved address just before it is dialled, since a name the operator
let reach private addresses may point at 127.0.0.1, at one of this host's own addresses, or
anywhere the service listens on, and names change.

An address leads to an endpoint on its port when it is loopback or unspecified (dialling
0.0.0.0 reaches this host), one of this host's own addresses, one the endpoint's host resolves
to, or any address at all when the endpoint listens on every address (`0.0.0.0`, `::`).
"""

from __future__ import annotations

import errno
import socket

from code_interpreter_wire.network_policy import IpAddress, PolicyError, address_of, normalize_host
from sandbox.egress.address_guard import forms_of
from sandbox.egress.resolver import Unreachable, lookup
from sandbox.egress.settings import EgressSettings, ServiceEndpoint


async def service_refusal(
    host: str, address: IpAddress, port: int, settings: EgressSettings
) -> str | None:
    """Why dialling `address` (what `host` resolved to) on `port` is refused because it may
    reach one of the service's own endpoints, or None."""
    for endpoint in settings.refused_endpoints:
        if endpoint.port == port and await _leads_to(endpoint, address, settings):
            where = f"{host} resolves to {address}, and port {port} there"
            if host == str(address):
                where = f"{address}:{port}"
            return (
                f"{where} may be {endpoint.what}, which no sandbox may reach through the proxy, "
                "whatever name leads there; call the service from outside the sandbox"
            )
    return None


async def _leads_to(
    endpoint: ServiceEndpoint, address: IpAddress, settings: EgressSettings
) -> bool:
    forms = forms_of(address)
    if any(form.is_loopback or form.is_unspecified for form in forms):
        return True
    listens_on = address_of(endpoint.host.strip("[]"))
    if endpoint.host in ("", "*") or (listens_on is not None and listens_on.is_unspecified):
        return True
    if any(is_own_address(form) for form in forms):
        return True
    try:
        theirs = await lookup(normalize_host(endpoint.host), endpoint.port, settings)
    except (Unreachable, PolicyError):
        return True  # cannot tell where the endpoint is: refused rather than risked
    their_forms = {form for found in theirs for form in forms_of(found)}
    return any(form in their_forms for form in forms)


def is_own_address(address: IpAddress) -> bool:
    """Whether `address` is one of this host's (the kernel lets a socket bind only to those).
    Anything but "not available here" counts as the host's own: refused when unsure."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True
