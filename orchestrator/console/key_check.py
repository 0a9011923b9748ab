"""Whether the key a console login was made with still works, known by its digest alone (the
console never keeps a key): a settings key while the settings name it; a key the CLI made while
its principal is not revoked and the digest is one of its keys, unexpired. The store is read at
most once a second per login key, off the event loop, so a revocation or a rotation logs the
console out within a second, on every replica."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import TYPE_CHECKING

from orchestrator.governance.policy import Principal
from orchestrator.governance.principals import digest_of, owner_of
from orchestrator.state_store.principal_store import PrincipalRecord

if TYPE_CHECKING:
    from orchestrator.service import Service

FRESH_S = 1.0
REMEMBERED = 1024  # digests whose store record is remembered (one per key logged in, about)


class KeyCheck:
    def __init__(self, service: Service) -> None:
        self._service = service
        settings = service.settings
        self._settings = [
            (digest_of(key).encode(), owner_of(key))
            for key in [*settings.api_keys, *settings.admin_keys]
        ]
        self._read: dict[str, tuple[float, PrincipalRecord | None]] = {}

    async def principal(self, digest: str, principal_id: str) -> Principal | None:
        """The principal `principal_id`, if the key of `digest` still authenticates as it."""
        principals = self._service.principals
        given = digest.encode()
        owner = None
        for known, known_owner in self._settings:  # each compared: timing tells nothing
            if hmac.compare_digest(given, known) and owner is None:
                owner = known_owner
        if owner is None:
            record = await self._record(digest)
            if record is None or record.revoked_at is not None:
                return None
            now = time.time()
            held = [k for k in record.keys if k.digest == digest]
            if not any(k.expires_at is None or k.expires_at > now for k in held):
                return None
            owner = record.id
        if owner != principal_id:
            return None
        return principals.of(owner)

    async def _record(self, digest: str) -> PrincipalRecord | None:
        now = time.monotonic()
        found = self._read.get(digest)
        if found is not None and now - found[0] < FRESH_S:
            return found[1]
        store = self._service.store.principals
        record = await asyncio.to_thread(store.principal_by_digest, digest)
        if len(self._read) >= REMEMBERED:
            self._read.clear()
        self._read[digest] = (now, record)
        return record
