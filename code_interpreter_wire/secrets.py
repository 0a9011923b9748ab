"""The credential vault's request and response bodies (`/v1/secrets`): a key stores a secret
under a name, bound to hosts; a session asking for it by name gets only a placeholder, which its
egress proxy replaces in requests to those hosts. A value is sent once and never answered back."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, field_validator

from code_interpreter_wire.network_policy import HostPattern, PolicyError

PLACEHOLDER_PREFIX = "cir-secret://"  # what a session's variable holds instead of the value
MAX_SECRET_BYTES = 8192
MAX_HOSTS = 16
MAX_METHODS = 16
MAX_PATH_PREFIXES = 16
MAX_PATH_PREFIX_CHARS = 512
MAX_SECRETS_PER_SESSION = 32
MAX_HEADERS = 16
MAX_HEADER_CHARS = 64
# The headers a secret may go in when its binding names none: where API keys travel.
DEFAULT_HEADERS = ("authorization", "x-api-key", "api-key")
# Headers that frame the request or concern one hop: never given a value (the proxy drops or
# rewrites those, so a value there would be lost, misframe the request or reach the wrong party);
# refused here with a 422, and by the proxy (sandbox/egress/credentials.py).
FRAMING_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
# An HTTP header name: a token (RFC 9110, 5.6.2).
HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
SECRET_NAME = r"[A-Z_][A-Z0-9_]{0,63}"  # an environment variable's name, upper case
SECRET_NAME_PATTERN = rf"^{SECRET_NAME}$"
_METHOD_PATTERN = r"^[A-Z]{1,16}$"
# What a header value may hold: printable ASCII and inner spaces only (CR, LF and NUL would let
# a value inject headers; h11 refuses other control characters and edge whitespace). The proxy
# checks the same (sandbox/egress/credentials.py).
VALUE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?\Z")

# An environment variable's name, as the session's code reads it (`os.environ["NAME"]`).
SecretName = Annotated[str, StringConstraints(pattern=SECRET_NAME_PATTERN)]


def placeholder(name: str) -> str:
    """What a session's variable `name` holds: the proxy swaps it for the value, host side."""
    return f"{PLACEHOLDER_PREFIX}{name}"


def _hosts(hosts: list[str]) -> list[str]:
    """Host names or `*.domain`, compared as network policies compare them (lowercase IDNA).
    The service also refuses a wildcard over a public or shared suffix (the Public Suffix List:
    orchestrator/vault/public_suffixes.py), which this package does not carry."""
    normalized: list[str] = []
    for host in hosts:
        if host.strip() == "*":
            raise ValueError("'*' would bind every host; name the hosts the secret is for")
        try:
            pattern = HostPattern.parse(host)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        if pattern.network is not None and "/" in pattern.text:
            raise ValueError(f"{host[:80]!r}: a network is not a host; name the host")
        if pattern.text not in normalized:
            normalized.append(pattern.text)
    return normalized


def checked_headers(headers: list[str]) -> list[str]:
    """Header names a secret may go in: lowercase, each once, in the order given; a name that
    is no HTTP token, or frames the request or concerns one hop, is refused (ValueError). The
    proxy holds its bindings to the same (sandbox/egress/credentials.py)."""
    normalized: list[str] = []
    for header in headers:
        if len(header) > MAX_HEADER_CHARS or not HEADER_NAME.match(header):
            raise ValueError(
                f"{header[:80]!r} is not a header name (an HTTP token of at most "
                f"{MAX_HEADER_CHARS} characters)"
            )
        lowered = header.lower()
        if lowered in FRAMING_HEADERS:
            raise ValueError(
                f"{lowered}: a header that frames the request or concerns one hop never gets a "
                "value"
            )
        if lowered not in normalized:
            normalized.append(lowered)
    return normalized


class StoreSecretRequest(BaseModel):
    """A secret stored (or replaced, under the same name) for the caller's key."""

    name: SecretName = Field(
        description="How sessions ask for it, and the name of their environment variable."
    )
    value: str = Field(
        repr=False,
        min_length=1,
        max_length=MAX_SECRET_BYTES,
        description=f"The secret itself (at most {MAX_SECRET_BYTES} bytes of printable "
        "ASCII); kept encrypted, never answered back, never put into a sandbox.",
    )
    hosts: list[str] = Field(
        min_length=1,
        max_length=MAX_HOSTS,
        description="The hosts whose requests get the value (`api.example.com`, "
        "`*.example.com`); a session's network policy must also allow them.",
    )
    methods: list[Annotated[str, StringConstraints(pattern=_METHOD_PATTERN)]] | None = Field(
        None, max_length=MAX_METHODS, description="Only requests of these methods; all if unset."
    )
    path_prefixes: (
        list[
            Annotated[
                str,
                StringConstraints(pattern=r"^/[^\x00-\x20]*$", max_length=MAX_PATH_PREFIX_CHARS),
            ]
        ]
        | None
    ) = Field(
        None,
        max_length=MAX_PATH_PREFIXES,
        description="Only requests whose path starts with one of these; all paths if unset.",
    )
    headers: list[str] | None = Field(
        None,
        min_length=1,
        max_length=MAX_HEADERS,
        description="The request headers the value may go in (names, any case); unset: "
        f"{', '.join(DEFAULT_HEADERS)}. A placeholder in any other header goes out unchanged.",
    )

    @field_validator("value")
    @classmethod
    def _value_fits(cls, value: str) -> str:
        # The value itself is never in the message.
        if not VALUE.match(value):
            raise ValueError(
                "must be printable ASCII with no control character (CR, LF, NUL...) and no "
                "leading or trailing whitespace: it goes into a request header"
            )
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts_readable(cls, hosts: list[str]) -> list[str]:
        return _hosts(hosts)

    @field_validator("methods")
    @classmethod
    def _methods_unique(cls, methods: list[str] | None) -> list[str] | None:
        return None if methods is None else sorted(set(methods))

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: list[str] | None) -> list[str] | None:
        return None if headers is None else checked_headers(headers)

    @property
    def bound_headers(self) -> list[str]:
        """The headers the value may go in: those given, else the default ones."""
        return list(DEFAULT_HEADERS) if self.headers is None else list(self.headers)


class SecretInfo(BaseModel):
    """A stored secret as its key sees it: never its value."""

    name: str
    hosts: list[str]
    methods: list[str] | None = None
    path_prefixes: list[str] | None = None
    headers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_HEADERS),
        description="The request headers the value may go in.",
    )
    placeholder: str = Field(description="What a session's variable of this name holds.")
    created_at: datetime
    updated_at: datetime


class SecretList(BaseModel):
    secrets: list[SecretInfo]
