"""A stored secret as the vault keeps it (sealed), and the refusals of the vault's calls."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from orchestrator.session_error import SessionError


class SecretRecord(BaseModel):
    """One secret of one owner: its binding in the clear, its value sealed (crypto.py)."""

    owner: str
    name: str
    hosts: list[str]
    methods: list[str] | None = None
    path_prefixes: list[str] | None = None
    nonce: str  # base64, 12 bytes
    ciphertext: str  # base64: AES-GCM of the value, bound to owner and name
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


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
