"""The host side of a sandbox's egress: an HTTP/HTTPS proxy on a Unix socket that decides each
connection by the session's network policy, dials only public addresses it resolved itself, and
logs every connection in the session's ledger."""

from sandbox.egress.credentials import CredentialBinding, CredentialBindings
from sandbox.egress.interception import GeneratedCa, TlsInterceptor, generate_ca
from sandbox.egress.ledger import EgressLedger, EgressRecord, EgressTotals
from sandbox.egress.proxy import EgressProxy
from sandbox.egress.settings import EgressSettings

__all__ = [
    "CredentialBinding",
    "CredentialBindings",
    "EgressLedger",
    "EgressProxy",
    "EgressRecord",
    "EgressSettings",
    "EgressTotals",
    "GeneratedCa",
    "TlsInterceptor",
    "generate_ca",
]
