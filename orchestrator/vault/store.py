"""Where sealed secrets are kept: the async interface both stores implement (`sqlite_store.py`
on one machine, `redis_store.py` in a cluster). A store sees only sealed values."""

from __future__ import annotations

from abc import ABC, abstractmethod

from orchestrator.vault.records import SecretRecord


class VaultStore(ABC):
    @abstractmethod
    async def put(self, record: SecretRecord, max_per_owner: int) -> bool:
        """Insert or replace the owner's secret of that name, keeping its `created_at` when
        replaced; True when it replaced one. SecretsFull when new and the owner already holds
        `max_per_owner`."""

    @abstractmethod
    async def get(self, owner: str, name: str) -> SecretRecord | None: ...

    @abstractmethod
    async def owned(self, owner: str) -> list[SecretRecord]:
        """The owner's secrets, by name."""

    @abstractmethod
    async def delete(self, owner: str, name: str) -> bool:
        """Whether there was one to delete."""

    @abstractmethod
    async def close(self) -> None: ...
