"""Whether the key a console login was made with still works, known by its digest alone (the
console never keeps a key). `Principals.authenticate_digest` answers it, exactly as it answers
for the key itself: a settings key while the settings name it; a key the CLI made while its
principal is not revoked and the digest is one of its keys, unexpired. Principals reads the store
again about once a second, so a revocation or a rotation logs the console out within a second,
on every replica."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.governance.policy import Principal

if TYPE_CHECKING:
    from orchestrator.service import Service


class KeyCheck:
    def __init__(self, service: Service) -> None:
        self._service = service

    async def principal(self, digest: str, principal_id: str) -> Principal | None:
        """The principal `principal_id`, if the key of `digest` still authenticates as it."""
        found = self._service.admission.authenticate_digest(digest)
        if found is None or found.id != principal_id:
            return None
        return found
