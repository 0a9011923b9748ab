"""Approval requests in the Redis every replica shares (cluster mode): a request made on one
replica is listed, and answered, through any other.

Keys, under the store's prefix: `approval:<id>` (the record's JSON), and sorted sets of ids by
creation time: `approvals` (every one), `approvals:owner:<owner>`, `approvals:pending`. A
decision is a WATCHed transaction: it writes only if the record is still pending, so of two
answers through two replicas one wins. Decided records expire after `retention_s` (as do pending
ones a dead replica left, past their own expiry plus that), and ids whose record is gone leave
the sets as listings meet them. At most the newest `max_kept` are kept besides those pending (a
sandbox calling a tool a webhook decides at once makes requests as fast as it loops): a put
removes the oldest decided ones past it, about once a second, a bounded number each time.

Awaited on the event loop with the connection's short timeout: a hung Redis costs the caller
a timeout, never the loop.
"""

from __future__ import annotations

import time
from typing import cast

import redis
from pydantic import ValidationError

from orchestrator.governance.stores.approval_store import (
    ApprovalRecord,
    ApprovalState,
    ApprovalStore,
)
from orchestrator.state_store.redis_connection import RedisConnection

DEFAULT_RETENTION_S = 30 * 86400.0
DEFAULT_MAX_KEPT = 100_000  # requests kept at most (the newest; pending ones stay)
_PAGE = 200
_TRIM_EVERY_S = 1.0
_TRIM_PAGES = 20  # the most pages one trim removes (it goes on at the next)


class RedisApprovals(ApprovalStore):
    def __init__(
        self,
        connection: RedisConnection,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_listed: int = 10_000,
        max_kept: int = DEFAULT_MAX_KEPT,
    ) -> None:
        """`connection`: the shared Redis (its client, key prefix and failures)."""
        self._redis = connection.client
        self._key = connection.key
        self._errors = connection.errors
        self.retention_s = retention_s
        self._max_listed = max_listed
        self.max_kept = max_kept
        self._trimmed_at = 0.0

    def _ttl(self, record: ApprovalRecord) -> int:
        if record.state == "pending":
            return max(1, int(record.expires_at - time.time() + self.retention_s))
        return max(1, int(self.retention_s))

    async def put_approval(self, record: ApprovalRecord) -> None:
        old = time.time() - self.retention_s
        every, mine = self._key("approvals"), self._key("approvals", "owner", record.owner)
        pending = self._key("approvals", "pending")
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(
                self._key("approval", record.id), record.model_dump_json(), ex=self._ttl(record)
            )
            pipe.zadd(every, {record.id: record.created_at})
            pipe.zadd(mine, {record.id: record.created_at})
            if record.state == "pending":
                pipe.zadd(pending, {record.id: record.created_at})
            else:
                pipe.zrem(pending, record.id)
            for listing in (every, mine, pending):  # ids older than any record kept
                pipe.zremrangebyscore(listing, "-inf", old)
            await pipe.execute()
        if time.monotonic() - self._trimmed_at >= _TRIM_EVERY_S:
            self._trimmed_at = time.monotonic()
            await self.trim()

    async def trim(self) -> int:
        """Remove the oldest decided requests past `max_kept` (up to a bound of pages; the next
        trim goes on); how many went."""
        every, pending = self._key("approvals"), self._key("approvals", "pending")
        gone = 0
        for _ in range(_TRIM_PAGES):
            with self._errors():
                excess = int(await self._redis.zcard(every)) - self.max_kept
                if excess <= 0:
                    break
                ids = [
                    i.decode()
                    for i in cast(
                        list[bytes], await self._redis.zrange(every, 0, min(excess, _PAGE) - 1)
                    )
                ]
                values = cast(
                    list[bytes | None],
                    await self._redis.mget([self._key("approval", i) for i in ids]),
                )
            pipe = self._redis.pipeline(transaction=False)
            dropped = []
            for approval_id, raw in zip(ids, values, strict=True):
                record = _load(raw)
                if record is not None and record.state == "pending":
                    continue  # its waiter decides it; it goes once decided and past the cap
                dropped.append(approval_id)
                pipe.delete(self._key("approval", approval_id))
                if record is not None:
                    pipe.zrem(self._key("approvals", "owner", record.owner), approval_id)
            if not dropped:
                break  # only pending ones are past the cap: nothing to remove now
            pipe.zrem(every, *dropped)
            pipe.zrem(pending, *dropped)
            with self._errors():
                await pipe.execute()
            gone += len(dropped)
        return gone

    async def get_approval(self, approval_id: str) -> ApprovalRecord | None:
        with self._errors():
            raw = cast(bytes | None, await self._redis.get(self._key("approval", approval_id)))
        return _load(raw)

    async def approvals(
        self,
        *,
        owner: str | None = None,
        state: ApprovalState | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[ApprovalRecord]:
        if state == "pending":
            listing = self._key("approvals", "pending")
        elif owner is not None:
            listing = self._key("approvals", "owner", owner)
        else:
            listing = self._key("approvals")
        found: list[ApprovalRecord] = []
        start = 0
        while len(found) < limit and start < self._max_listed:
            with self._errors():
                ids = [
                    i.decode()
                    for i in cast(
                        list[bytes], await self._redis.zrevrange(listing, start, start + _PAGE - 1)
                    )
                ]
                if not ids:
                    break
                values = cast(
                    list[bytes | None],
                    await self._redis.mget([self._key("approval", i) for i in ids]),
                )
            gone = []
            for approval_id, raw in zip(ids, values, strict=True):
                record = _load(raw)
                if record is None:
                    gone.append(approval_id)
                    continue
                if (
                    (owner is None or record.owner == owner)
                    and (state is None or record.state == state)
                    and (session_id is None or record.session_id == session_id)
                ):
                    found.append(record)
            if gone:
                with self._errors():
                    await self._redis.zrem(listing, *gone)
            start += len(ids) - len(gone)  # the gone ones left the set
        return found[: max(0, limit)]

    async def decide_approval(
        self, approval_id: str, state: ApprovalState, by: str, reason: str | None, at: float
    ) -> ApprovalRecord | None:
        key = self._key("approval", approval_id)
        with self._errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                for _ in range(10):  # a lost race re-reads: by then it is decided, or not
                    try:
                        await pipe.watch(key)
                        record = _load(cast(bytes | None, await pipe.get(key)))
                        if record is None or record.state != "pending":
                            await pipe.unwatch()  # type: ignore[no-untyped-call]
                            return None
                        decided = record.model_copy(
                            update={
                                "state": state,
                                "decided_by": by,
                                "reason": reason,
                                "decided_at": at,
                            }
                        )
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.set(key, decided.model_dump_json(), ex=self._ttl(decided))
                        pipe.zrem(self._key("approvals", "pending"), approval_id)
                        await pipe.execute()
                        return decided
                    except redis.WatchError:
                        continue
        return None


def _load(raw: bytes | None) -> ApprovalRecord | None:
    """A record, or None where there is none or it is not one of ours (skipped, not fatal)."""
    if raw is None:
        return None
    try:
        return ApprovalRecord.model_validate_json(raw)
    except ValidationError:
        return None
