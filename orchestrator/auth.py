"""Who is calling: a bearer key, told apart by `Principals` (the settings' keys and the keys the
CLI made), and known afterwards by its principal's owner id, never by the key."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException, Request

from orchestrator.config import Settings
from orchestrator.governance.policy import Principal
from orchestrator.governance.principals import LOCAL_OWNER, NO_KEYS_YET, Principals, owner_of

__all__ = ["LOCAL_OWNER", "Authenticator", "owner_of"]


class Authenticator:
    """Every front door's check of a key (REST, MCP, the E2B front, terminals' WebSockets).
    It is made before the service starts; `principals` gives the service's once it has (until
    then, the settings' keys alone answer)."""

    def __init__(
        self, settings: Settings, principals: Callable[[], Principals | None] | None = None
    ) -> None:
        self.disabled = settings.auth_disabled
        self._principals = principals
        self._settings_only = Principals(settings, None)

    def principals(self) -> Principals:
        found = self._principals() if self._principals is not None else None
        return found if found is not None else self._settings_only

    def __call__(self, request: Request) -> str:
        """FastAPI dependency: the caller's owner id, or 401."""
        return self.principal(request).id

    def principal(self, request: Request) -> Principal:
        """The caller, or 401."""
        if self.disabled:
            return self.principal_for_key("")
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise HTTPException(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return self.principal_for_key(key)

    def owner_for_key(self, key: str) -> str:
        """The owner id of a key given in any header, or 401 (LOCAL_OWNER when auth is off)."""
        return self.principal_for_key(key).id

    def principal_for_key(self, key: str) -> Principal:
        principals = self.principals()
        found = principals.authenticate(key)
        if found is None:
            raise HTTPException(
                401,
                "invalid API key (unknown, revoked, or replaced by a rotation)"
                if principals.has_keys
                else NO_KEYS_YET,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found
