"""A stored secret as the vault keeps it (sealed), and the refusals of the vault's calls."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from code_interpreter_wire.secrets import DEFAULT_HEADERS
from orchestrator.session_error import SessionError


class SecretBinding(BaseModel):
    """Where a secret's value may go: hosts, and optionally methods and path prefixes, and the
    headers it may be put in. Sealed into its ciphertext's associated data (crypto.py), so a
    binding changed at rest no longer opens."""

    hosts: list[str]
    methods: list[str] | None = None
    path_prefixes: list[str] | None = None
    headers: list[str] = Field(default_factory=lambda: list(DEFAULT_HEADERS))


class SecretRecord(SecretBinding):
    """One secret of one owner: its binding in the clear, its value sealed (crypto.py)."""

    owner: str
    name: str
    nonce: str  # base64, 12 bytes
    ciphertext: str  # base64: AES-GCM of the value, bound to owner, name and binding
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)

    @property
    def binding(self) -> SecretBinding:
        return SecretBinding(
            hosts=self.hosts,
            methods=self.methods,
            path_prefixes=self.path_prefixes,
            headers=self.headers,
        )


class SecretNotFound(SessionError):
    """No secret of that name for this key (another key's is reported exactly the same)."""

    status = 404


class InvalidSecret(SessionError):
    """A secret the egress proxy could not bind as given (the message says why; never the
    value)."""

    status = 400


class SecretsFull(SessionError):
    """The key holds as many secrets as it may: delete one first."""

    status = 409


class SecretsNotAvailable(SessionError):
    """A session asked for secrets it cannot have: unknown names, hosts its network policy
    does not reach, or a backend whose proxy is not this service's."""

    status = 400


class VaultSettingError(ValueError):
    """A vault setting that cannot be used as given (a malformed key, an unreadable CA file):
    the service does not start, and says which."""


class VaultUnavailable(SessionError):
    """The vault cannot be used here (its key or CA missing): the message says what to set."""

    status = 503
