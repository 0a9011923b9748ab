"""Session records and saved states in a Redis shared by every service replica (the
connection: redis_connection.py; what the replicas coordinate through, caps, claims and
tombstones: orchestrator/cluster/coordination_store.py).

Every key is under one prefix. Values are the records' own JSON, validated when read back: a
corrupt value is `CorruptRecord`, an unreachable server `StoreUnavailable`, never a crash.
Listings walk with SCAN/SSCAN a page at a time and stop at `max_listed`; the reaper walks
only the set of running sessions (never every key: tombstones and claims outnumber them), and
the orphan sweep asks a set of named handles, never a listing that may have been cut short.

Every call is awaited with the connection's short timeout: a hung Redis costs those calls a
timeout, never the loop (/healthz, calls on cached sessions).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar, cast

from pydantic import BaseModel
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from orchestrator.state_store.interfaces import StateStore, with_changes
from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)
from orchestrator.state_store.redis_connection import (
    PAGE,
    CorruptRecord,
    RedisConnection,
    StoreUnavailable,
    load,
)

log = logging.getLogger(__name__)
Record = TypeVar("Record", bound=BaseModel)

_PAGE = PAGE
_UNRECORDED_AFTER_S = 3600.0  # a saved state's directory unrecorded this long was left by a crash
__all__ = ["CorruptRecord", "RedisStore", "StoreUnavailable"]


_WRITE_TRIES = 16  # a record another replica kept changing: the write gives up after this many


# KEYS: the record, its owner's index, the running set, the handles set. ARGV: its JSON, its id,
# its state, its sandbox handle and its suspended sandbox's handle ('' for none).
_PUT = """
local old = redis.call('GET', KEYS[1])
if old then
  local ok, was = pcall(cjson.decode, old)
  if ok and type(was) == 'table' then
    for _, field in ipairs({'sandbox_handle', 'suspended'}) do
      local handle = was[field]
      if type(handle) == 'string' and handle ~= ARGV[4] and handle ~= ARGV[5] then
        redis.call('SREM', KEYS[4], handle)
      end
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
if ARGV[3] == 'running' then
  redis.call('SADD', KEYS[3], ARGV[2])
else
  redis.call('SREM', KEYS[3], ARGV[2])
end
if ARGV[4] ~= '' then redis.call('SADD', KEYS[4], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('SADD', KEYS[4], ARGV[5]) end
return 1
"""


class RedisStore(StateStore):
    shared = True

    def __init__(
        self,
        connection: RedisConnection,
        *,
        snapshots_dir: Path,
        max_listed: int = 10_000,
    ) -> None:
        """`connection`: the Redis every replica shares. `snapshots_dir`: where saved states'
        files go (shared by the replicas where saved states are used). `max_listed`: the most
        records one listing returns."""
        self.connection = connection
        self._redis = connection.client
        self._max_listed = max_listed
        self._files = snapshots_dir
        self._files.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._put = self._redis.register_script(_PUT)

    async def ping(self) -> None:
        await self.connection.ping()

    async def close(self) -> None:
        """The connection is closed by whoever opened it (other stores share it)."""

    # --- keys
    def _key(self, *parts: str) -> str:
        return self.connection.key(*parts)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        with self.connection.errors():
            yield

    def _load(self, kind: type[Record], raw: bytes | None, key: str) -> Record | None:
        return load(kind, raw, key)

    async def _load_many(self, kind: type[Record], keys: list[str]) -> list[Record]:
        """The records at `keys` (missing ones skipped); a corrupt one is logged and skipped so
        that one bad value does not hide every other record from a listing."""
        return [r for r in await self._load_each(kind, keys) if r is not None]

    async def _load_each(self, kind: type[Record], keys: list[str]) -> list[Record | None]:
        """The record at each key, None where there is none or it is corrupt (logged)."""
        found: list[Record | None] = []
        for start in range(0, len(keys), _PAGE):
            page = keys[start : start + _PAGE]
            with self._errors():
                values = cast(list[bytes | None], await self._redis.mget(page)) if page else []
            for key, raw in zip(page, values, strict=True):
                try:
                    found.append(self._load(kind, raw, key))
                except CorruptRecord as exc:
                    log.error("%s (skipped)", exc)
                    found.append(None)
        return found

    async def _scan(self, pattern: str) -> list[str]:
        """Keys matching `pattern`, at most `max_listed`."""
        keys: list[str] = []
        with self._errors():
            async for key in self._redis.scan_iter(match=pattern, count=_PAGE):
                keys.append(key.decode())
                if len(keys) >= self._max_listed:
                    log.warning("listing %s stopped at %d keys", pattern, self._max_listed)
                    break
        return keys

    async def _members(self, key: str) -> list[str]:
        """Members of a set, at most `max_listed`."""
        members: list[str] = []
        with self._errors():
            async for member in self._redis.sscan_iter(key, count=_PAGE):
                members.append(member.decode())
                if len(members) >= self._max_listed:
                    log.warning("listing %s stopped at %d members", key, self._max_listed)
                    break
        return members

    # --- sessions
    async def put_session(self, record: SessionRecord) -> None:
        """Also kept: the set of running sessions (the reapers' walk) and of the sandbox
        handles records name, a paused whole sandbox's too (the orphan sweep's: a handle the
        record no longer names, once paused or resumed in another sandbox, leaves it). The
        labels of a record already there stay (see StateStore.put_session)."""
        key = self._key("session", record.id)
        keys = [
            key,
            self._key("owner-sessions", record.owner),
            self._key("running"),
            self._key("handles"),
        ]

        async def write(pipe: Pipeline, old: SessionRecord | None) -> bool:
            kept = record if old is None else record.model_copy(update={"labels": old.labels})
            args = [
                kept.model_dump_json(),
                record.id,
                record.state,
                record.sandbox_handle or "",
                record.suspended or "",
            ]
            await self._put(keys=keys, args=args, client=pipe)
            return True

        await self._rewrite(key, write, corrupt_is_none=True)

    async def set_session_labels(
        self, session_id: str, changes: Mapping[str, str | None]
    ) -> dict[str, str] | None:
        """Change only the record's labels (see StateStore), read and written in one
        transaction."""
        key = self._key("session", session_id)
        merged: dict[str, str] | None = None

        async def write(pipe: Pipeline, old: SessionRecord | None) -> bool:
            nonlocal merged
            if old is None:
                return False
            merged = with_changes(old.labels, changes)
            pipe.set(key, old.model_copy(update={"labels": merged}).model_dump_json())
            return True

        return merged if await self._rewrite(key, write) else None

    async def _rewrite(
        self,
        key: str,
        write: Callable[[Pipeline, SessionRecord | None], Awaitable[bool]],
        *,
        corrupt_is_none: bool = False,
    ) -> bool:
        """Read the record at `key` and have `write` queue its new value (or return False to
        write nothing) in one transaction that holds only if no one wrote the record between
        (WATCH): tried again then, up to `_WRITE_TRIES` times. `corrupt_is_none`: a record
        that cannot be read is written over as if there were none."""
        with self._errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                for _ in range(_WRITE_TRIES):
                    try:
                        await pipe.watch(key)
                        raw = cast(bytes | None, await pipe.get(key))
                        try:
                            old = self._load(SessionRecord, raw, key)
                        except CorruptRecord:
                            if not corrupt_is_none:
                                raise
                            old = None
                        pipe.multi()  # type: ignore[no-untyped-call]
                        if not await write(pipe, old):
                            return False
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue
        raise StoreUnavailable(
            f"the record at {key} kept changing under {_WRITE_TRIES} tries to write it; retry"
        )

    async def get_session(self, session_id: str) -> SessionRecord | None:
        key = self.session_key(session_id)
        with self._errors():
            raw = cast(bytes | None, await self._redis.get(key))
        return self._load(SessionRecord, raw, key)

    def session_key(self, session_id: str) -> str:
        """Where a session's record is (read with other keys in one round trip)."""
        return self._key("session", session_id)

    def session_record(self, raw: bytes | None, session_id: str) -> SessionRecord | None:
        """A record read raw from `session_key`, validated."""
        return self._load(SessionRecord, raw, self.session_key(session_id))

    async def delete_session(self, session_id: str) -> None:
        key = self._key("session", session_id)
        try:
            record = await self.get_session(session_id)
        except CorruptRecord:
            record = None  # deleted all the same; its owner's index forgets it when listed
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.srem(self._key("running"), session_id)
            if record is not None:
                pipe.srem(self._key("owner-sessions", record.owner), session_id)
                for handle in (record.sandbox_handle, record.suspended):
                    if handle is not None:
                        pipe.srem(self._key("handles"), handle)
            await pipe.execute()

    async def sessions(
        self,
        *,
        owner: str | None = None,
        state: SessionState | None = None,
        backend: str | None = None,
        before: float | None = None,
    ) -> list[SessionRecord]:
        if owner is not None:
            ids = await self._members(self._key("owner-sessions", owner))
            keys = [self._key("session", i) for i in ids]
        else:
            keys = await self._scan(self._key("session", "*"))
        found = [
            r
            for r in await self._load_many(SessionRecord, keys)
            if (owner is None or r.owner == owner)
            and (state is None or r.state == state)
            and (backend is None or r.backend == backend)
            and (before is None or r.state_since < before)
        ]
        return sorted(found, key=lambda r: r.state_since)

    async def count_sessions(self, owner: str, state: SessionState) -> int:
        return len(await self.sessions(owner=owner, state=state))

    async def scan_sessions(self, cursor: int, count: int) -> tuple[int, list[SessionRecord]]:
        """One step of a walk over the running sessions (their set, not every key): (the next
        cursor, 0 when the walk is done; about `count` records). A reaper walks a bounded piece
        per round this way. Ids whose record is gone leave the set."""
        running = self._key("running")
        with self._errors():
            cursor, members = await self._redis.sscan(running, cursor=cursor, count=count)
        ids = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        keys = [self._key("session", i) for i in ids]
        records = await self._load_each(SessionRecord, keys)
        unread = [i for i, r in zip(ids, records, strict=True) if r is None]
        if unread:  # missing, or corrupt (kept: a corrupt record still exists)
            with self._errors():
                pipe = self._redis.pipeline(transaction=False)
                for i in unread:
                    pipe.exists(self._key("session", i))
                missing = [i for i, n in zip(unread, await pipe.execute(), strict=True) if not n]
                if missing:
                    await self._redis.srem(running, *missing)
        return int(cursor), [r for r in records if r is not None]

    async def handles_named(self, handles: list[str]) -> set[str]:
        """Which of these sandbox handles a session record names (asked of the set every
        record's handle is kept in, so never cut short like a listing)."""
        named: set[str] = set()
        key = self._key("handles")
        for start in range(0, len(handles), _PAGE):
            page = handles[start : start + _PAGE]
            with self._errors():
                found = cast(list[int], await self._redis.smismember(key, page))
            named |= {h for h, yes in zip(page, found, strict=True) if yes}
        return named

    async def handles_in_records(self, handles: set[str]) -> set[str]:
        """Which of these handles a session record names, found by reading every record (a
        walk of the whole store, page by page, never cut short): what the orphan sweep asks
        before it ends anything, so that a handle missing from the set (a record written
        before the set kept paused machines', or a write the set missed) is never taken for an
        orphan. Those found are put back in the set."""
        named: set[str] = set()
        with self._errors():
            async for page in self._pages(self._key("session", "*")):
                values = cast(list[bytes | None], await self._redis.mget(page))
                for key, raw in zip(page, values, strict=True):
                    found = _handles_of(raw)
                    if found is None:  # it may name any of them: none is taken for an orphan
                        log.error("%s is not a readable session record: nothing is swept", key)
                        return set(handles)
                    named |= handles & found
            if named:
                await self._redis.sadd(self._key("handles"), *named)
        return named

    async def _pages(self, pattern: str) -> AsyncIterator[list[str]]:
        """Every key matching `pattern`, a page at a time (SCAN: a key there throughout the
        walk is seen at least once)."""
        cursor = 0
        while True:
            cursor, keys = await self._redis.scan(cursor=cursor, match=pattern, count=_PAGE)
            if keys:
                yield [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
            if not cursor:
                return

    # --- snapshots
    def files_of(self, snapshot_id: str) -> Path:
        if not snapshot_id.replace("-", "").isalnum():  # ids are made here; never a path
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self._files / snapshot_id

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self._key("snapshot", record.id), record.model_dump_json())
            pipe.sadd(self._key("owner-snapshots", record.owner), record.id)
            await pipe.execute()

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        key = self._key("snapshot", snapshot_id)
        with self._errors():
            raw = cast(bytes | None, await self._redis.get(key))
        return self._load(SnapshotRecord, raw, key)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        try:
            record = await self.get_snapshot(snapshot_id)
        except CorruptRecord:
            record = None
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._key("snapshot", snapshot_id))
            if record is not None:
                pipe.srem(self._key("owner-snapshots", record.owner), snapshot_id)
            await pipe.execute()
        await asyncio.to_thread(shutil.rmtree, self.files_of(snapshot_id), True)  # files

    async def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        if owner is not None:
            ids = await self._members(self._key("owner-snapshots", owner))
            keys = [self._key("snapshot", i) for i in ids]
        else:
            keys = await self._scan(self._key("snapshot", "*"))
        found = [
            r
            for r in await self._load_many(SnapshotRecord, keys)
            if (owner is None or r.owner == owner)
            and (kind is None or r.kind == kind)
            and (session_id is None or r.session_id == session_id)
        ]
        return sorted(found, key=lambda r: r.created_at, reverse=True)

    async def usage(self, owner: str) -> tuple[int, int]:
        mine = await self.snapshots(owner=owner)
        return sum(1 for r in mine if r.kind == "snapshot"), sum(r.bytes for r in mine)

    async def orphan_files(self) -> list[Path]:
        """Saved states' directories no record names (a crash between writing and recording).
        Each directory is asked about by name, never against a listing that may be cut short.
        The directory may be every replica's: one written to within `_UNRECORDED_AFTER_S` may
        be another replica's save under way, so it is left for a later start."""
        dirs = await asyncio.to_thread(
            _settled_dirs, self._files, time.time() - _UNRECORDED_AFTER_S
        )
        orphans: list[Path] = []
        for start in range(0, len(dirs), _PAGE):
            page = dirs[start : start + _PAGE]
            with self._errors():
                pipe = self._redis.pipeline(transaction=False)
                for d in page:
                    pipe.exists(self._key("snapshot", d.name))
                orphans += [d for d, n in zip(page, await pipe.execute(), strict=True) if not n]
        return orphans


def _settled_dirs(root: Path, before: float) -> list[Path]:
    """The entries of `root` neither they nor their direct entries changed since `before`."""
    settled = []
    for entry in root.iterdir():
        try:
            newest = max(
                [entry.lstat().st_mtime]
                + ([c.lstat().st_mtime for c in entry.iterdir()] if entry.is_dir() else [])
            )
        except OSError:  # removed meanwhile
            continue
        if newest < before:
            settled.append(entry)
    return settled


def _handles_of(raw: bytes | None) -> set[str] | None:
    """The sandbox handles a raw session record names; None if it is unreadable (a record
    gone since it was listed names nothing)."""
    if raw is None:
        return set()
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {h for h in (value.get("sandbox_handle"), value.get("suspended")) if isinstance(h, str)}
