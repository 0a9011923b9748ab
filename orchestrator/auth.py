"""Who is calling: a bearer key from the configured list, known afterwards only by a digest."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import HTTPException, Request

from orchestrator.config import Settings

LOCAL_OWNER = "local"  # the one owner when auth is explicitly disabled


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self.disabled = settings.auth_disabled
        self._keys = [k.encode() for k in settings.api_keys]

    def __call__(self, request: Request) -> str:
        """FastAPI dependency: the caller's owner id, or 401."""
        if self.disabled:
            return LOCAL_OWNER
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise HTTPException(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return self.owner_for_key(key)

    def owner_for_key(self, key: str) -> str:
        """The owner id of a key given in any header, or 401 (LOCAL_OWNER when auth is off)."""
        if self.disabled:
            return LOCAL_OWNER
        given = key.strip().encode()
        # Compare against every key, in constant time, so timing tells nothing.
        matched = False
        for known in self._keys:
            matched |= hmac.compare_digest(given, known)
        if not matched or not given:
            raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return owner_of(key.strip())
