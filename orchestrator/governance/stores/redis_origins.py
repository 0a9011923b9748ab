"""The running origins of host-tool calls (orchestrator/governance/call_origins.py) in the Redis
every replica shares: a replica that takes a call of code another replica runs learns here that
its execution (or command, process, terminal) still runs, and what code to show a human.

Keys, under the store's prefix: `origin:<session id>:<token>`, the record's JSON, with a short
time to live the replica running the origin renews while it runs (call_origins.py), so one a
dead replica left expires alone.
Awaited on the event loop with the connection's short timeout.
"""

from __future__ import annotations

from pydantic import ValidationError

from orchestrator.governance.stores.origin_record import OriginRecord
from orchestrator.state_store.redis_connection import RedisConnection

MAX_CODE_CHARS = 64 << 10  # what an approval shows is capped there too (approvals.py)


class RedisOrigins:
    def __init__(self, connection: RedisConnection) -> None:
        """`connection`: the shared Redis (its client, key prefix and failures)."""
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors

    async def put_origin(
        self, session_id: str, origin: str, record: OriginRecord, ttl_s: float
    ) -> None:
        kept = record.model_copy(update={"code": record.code[:MAX_CODE_CHARS]})
        with self._errors():
            await self._redis.set(
                self._key("origin", session_id, origin),
                kept.model_dump_json(),
                px=max(1, int(ttl_s * 1000)),
            )

    async def get_origin(self, session_id: str, origin: str) -> OriginRecord | None:
        with self._errors():
            raw = await self._redis.get(self._key("origin", session_id, origin))
        if raw is None:
            return None
        try:
            return OriginRecord.model_validate_json(raw)
        except ValidationError:  # not what a replica wrote: not a running origin
            return None

    async def refresh_origins(self, origins: list[tuple[str, str]], ttl_s: float) -> None:
        """Renew each one's time to live, in one round trip; one deleted meanwhile stays
        deleted (PEXPIRE creates nothing)."""
        if not origins:
            return
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            for session_id, origin in origins:
                pipe.pexpire(self._key("origin", session_id, origin), max(1, int(ttl_s * 1000)))
            await pipe.execute()

    async def delete_origin(self, session_id: str, origin: str) -> None:
        with self._errors():
            await self._redis.delete(self._key("origin", session_id, origin))
