"""Keys as principals: the async interface and record both stores implement (`sqlite_principals.py`,
`redis_principals.py`). A key is never kept, only its SHA-256 digest."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from pydantic import BaseModel, Field

from orchestrator.governance.policy import Policy


class KeyDigest(BaseModel):
    digest: str  # sha256 hex of the key
    created_at: float = Field(default_factory=time.time)
    expires_at: float | None = None  # an old key still good for a grace period after rotation


class PrincipalRecord(BaseModel):
    id: str  # the owner id of its sessions, snapshots and audit events; never changes
    name: str  # unique
    admin: bool = False
    policy: Policy = Field(default_factory=Policy)
    keys: list[KeyDigest] = Field(default_factory=list)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    revoked_at: float | None = None


class PrincipalNameTaken(ValueError):
    """Another principal holds this name (names are unique; ids never change)."""


class PrincipalStore(ABC):
    @abstractmethod
    async def put_principal(self, record: PrincipalRecord) -> None:
        """Insert or replace, with its key digests (a digest no longer listed stops working);
        PrincipalNameTaken if another principal has its name."""

    @abstractmethod
    async def get_principal(self, name: str) -> PrincipalRecord | None: ...

    @abstractmethod
    async def principal_by_id(self, principal_id: str) -> PrincipalRecord | None: ...

    @abstractmethod
    async def principal_by_digest(self, digest: str) -> PrincipalRecord | None:
        """The principal holding this key digest (revoked ones included: the caller decides)."""

    @abstractmethod
    async def principals(self) -> list[PrincipalRecord]: ...
