"""Sealed secrets in the Redis a cluster's replicas share: a hash per owner
(`vault:<owner>`: name -> the record's JSON). A put is one Lua script, so the per-key cap holds
whichever replica stores."""

from __future__ import annotations

from orchestrator.state_store.redis_connection import RedisConnection, text
from orchestrator.vault.records import SecretRecord, SecretsFull
from orchestrator.vault.store import VaultStore

# KEYS: the owner's hash. ARGV: name, the record's JSON, the cap. Returns "new", "replaced" or
# "full".
_PUT = """
local held = redis.call('HEXISTS', KEYS[1], ARGV[1])
if held == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'full' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if held == 1 then return 'replaced' end
return 'new'
"""


class RedisVault(VaultStore):
    def __init__(self, connection: RedisConnection) -> None:
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self._put = self._redis.register_script(_PUT)

    async def put(self, record: SecretRecord, max_per_owner: int) -> bool:
        earlier = await self.get(record.owner, record.name)
        if earlier is not None:
            record = record.model_copy(update={"created_at": earlier.created_at})
        keys = [self._key("vault", record.owner)]
        with self._errors():
            answer = text(
                await self._put(
                    keys=keys, args=[record.name, record.model_dump_json(), max_per_owner]
                )
            )
        if answer == "full":
            raise SecretsFull(f"this key holds {max_per_owner} secrets, the most it may")
        return answer == "replaced"

    async def get(self, owner: str, name: str) -> SecretRecord | None:
        with self._errors():
            doc = await self._redis.hget(self._key("vault", owner), name)
        return None if doc is None else SecretRecord.model_validate_json(doc)

    async def owned(self, owner: str) -> list[SecretRecord]:
        with self._errors():
            docs = await self._redis.hgetall(self._key("vault", owner))
        records = [SecretRecord.model_validate_json(d) for d in docs.values()]
        return sorted(records, key=lambda r: r.name)

    async def delete(self, owner: str, name: str) -> bool:
        with self._errors():
            return bool(await self._redis.hdel(self._key("vault", owner), name))

    async def close(self) -> None:
        """The connection is the service's, closed with its other stores."""
