"""Both stores in a Redis shared by every service replica, plus the atomic operations cluster
mode needs: admission against the caps, a claim that makes each end happen once, tombstones.

Why Redis (docs/cluster.md): Ray's GCS fault tolerance needs one anyway; it outlives the head
node and every replica; a Lua script runs atomically whichever replica sends it. Ray's internal
KV is not a public API, and a registry actor would lose its state with the head node.

Every key is under one prefix. Values are the records' own JSON, validated when read back: a
corrupt value is `CorruptRecord`, an unreachable server `StoreUnavailable`, never a crash.
Listings walk with SCAN/SSCAN a page at a time and stop at `max_listed`; the reaper walks
only the set of running sessions (never every key: tombstones and claims outnumber them), and
the orphan sweep asks a set of named handles, never a listing that may have been cut short.

The client is synchronous with short timeouts (`timeout_s`, 1 s by default): the cluster's
session manager calls it off the event loop (a thread each call), so a hung Redis costs those
calls a timeout, never the loop (/healthz, calls on cached sessions).

Admission is a Lua script rather than MULTI/WATCH: the check and the reservation are one step on
the server, so concurrent creates through many replicas neither pass the cap nor abort and retry
(WATCH would make every loser of a race go round again, under exactly the load caps are for).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar, cast

import redis
from pydantic import BaseModel, ValidationError

from orchestrator.sessions import SessionError
from orchestrator.state_store.interfaces import SessionStore, SnapshotStore
from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)
from orchestrator.state_store.redis_approvals import RedisApprovals
from orchestrator.state_store.redis_audit import RedisAudit
from orchestrator.state_store.redis_auth import (
    RISK,
    answers_without_password,
    check_store_url,
    open_server_refused,
    shown_url,
)
from orchestrator.state_store.redis_origins import RedisOrigins
from orchestrator.state_store.redis_principals import RedisPrincipals

log = logging.getLogger(__name__)
Record = TypeVar("Record", bound=BaseModel)

_PAGE = 200  # keys asked of each SCAN step, and read by each MGET
_TIMEOUT_S = 1.0  # a store that does not answer within this is unavailable, not waited on


class StoreUnavailable(SessionError):
    """The shared store (Redis) cannot be reached or failed: nothing was changed by this call."""

    status = 503


class CorruptRecord(SessionError):
    """A value read back from the shared store is not what this service wrote there."""

    status = 500


class Tombstone(BaseModel):
    """An ended session: whose it was and why it ended (told as 410 by every replica)."""

    owner: str
    why: str


class Slot(BaseModel):
    """A reserved place under the caps: whose, and since when (to give back abandoned ones)."""

    owner: str
    at: float


# Reserve a slot for ARGV[1] unless a cap is reached: returns "ok", or "total:N" / "key:N".
# KEYS: every slot (set), the owner's slots (set), the slots' details (hash).
# ARGV: session id, cap per key, cap in total, the slot's JSON.
_ADMIT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 'ok' end
local total = redis.call('SCARD', KEYS[1])
if total >= tonumber(ARGV[3]) then return 'total:' .. total end
local mine = redis.call('SCARD', KEYS[2])
if mine >= tonumber(ARGV[2]) then return 'key:' .. mine end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
return 'ok'
"""

# End a session once across replicas, in one step: the claim, the tombstone and the place given
# back together, so no replica can die between them and leave a claim that ends nothing.
# Returns "won", or the tombstone's JSON (a loser: someone ended it first; "" if it lapsed).
# KEYS: the claim, the tombstone, every slot (set), the owner's slots (set), the slots' details.
# ARGV: session id, the tombstone's JSON, claim TTL (s), tombstone TTL (s).
_END = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  return redis.call('GET', KEYS[2]) or ''
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[4]))
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 'won'
"""

# Update a session's record only if it still exists (another replica may have deleted it).
# KEYS: the record. ARGV: its new JSON. Returns 1 if updated.
_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class RedisStore(SessionStore, SnapshotStore):
    def __init__(
        self,
        url: str,
        *,
        snapshots_dir: Path,
        prefix: str = "cir",
        tombstone_ttl_s: float = 86400.0,
        max_lifetime_s: float = 86400.0,
        max_listed: int = 10_000,
        timeout_s: float = _TIMEOUT_S,
        allow_unauthenticated: bool = False,
    ) -> None:
        """`url`: redis://:PASSWORD@HOST:PORT/DB. `snapshots_dir`: where saved states' files go
        (shared by the replicas where saved states are used). `max_lifetime_s`: the longest a
        session lives (an end's claim outlasts it and its tombstone, so no late end goes round
        again). `max_listed`: the most records one listing returns. `timeout_s`: the longest
        any call waits for the server. `allow_unauthenticated`: use a Redis without a password
        (else `UnauthenticatedStore`, before connecting; see redis_auth)."""
        check_store_url(url, allow_unauthenticated=allow_unauthenticated)
        self._allow_unauthenticated = allow_unauthenticated
        self._timeout_s = timeout_s
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        self._url = url
        self._p = prefix
        self._ttl = max(1, int(tombstone_ttl_s))
        self._claim_ttl = self._ttl + max(1, int(max_lifetime_s)) + 60
        self._max_listed = max_listed
        self._files = snapshots_dir
        self._files.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._admit = self._redis.register_script(_ADMIT)
        self._end = self._redis.register_script(_END)
        self._update = self._redis.register_script(_UPDATE)
        self.approvals = RedisApprovals(self._redis, self._key, self._errors, max_listed=max_listed)
        self.audit = RedisAudit(self._redis, self._key, self._errors)
        self.principals = RedisPrincipals(self._redis, self._key, self._errors)
        self.origins = RedisOrigins(self._redis, self._key, self._errors)

    def close(self) -> None:
        self._redis.close()

    def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers, and `UnauthenticatedStore` if it
        also answers a connection that sends no password, unless that is allowed (then said
        in the log). Checked when the service starts, and by the CLI."""
        with self._errors():
            self._redis.ping()
            if not answers_without_password(self._url, self._timeout_s):
                return
        if not self._allow_unauthenticated:
            raise open_server_refused(self._url)
        log.warning(
            "the shared store (%s) takes connections without a password, as "
            "store_allow_unauthenticated allows: %s; only safe where nothing but the service's "
            "replicas and Ray reach it",
            shown_url(self._url),
            RISK,
        )

    # --- keys
    def _key(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"the shared session store ({shown_url(self._url)}) failed: {exc}; try again"
            ) from None

    def _load(self, kind: type[Record], raw: bytes | None, key: str) -> Record | None:
        if raw is None:
            return None
        try:
            return kind.model_validate_json(raw)
        except ValidationError as exc:
            raise CorruptRecord(
                f"the shared store holds a corrupt {kind.__name__} at {key!r}: "
                f"{exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}"
            ) from None

    def _load_many(self, kind: type[Record], keys: list[str]) -> list[Record]:
        """The records at `keys` (missing ones skipped); a corrupt one is logged and skipped so
        that one bad value does not hide every other record from a listing."""
        return [r for r in self._load_each(kind, keys) if r is not None]

    def _load_each(self, kind: type[Record], keys: list[str]) -> list[Record | None]:
        """The record at each key, None where there is none or it is corrupt (logged)."""
        found: list[Record | None] = []
        for start in range(0, len(keys), _PAGE):
            page = keys[start : start + _PAGE]
            with self._errors():
                values = cast(list[bytes | None], self._redis.mget(page)) if page else []
            for key, raw in zip(page, values, strict=True):
                try:
                    found.append(self._load(kind, raw, key))
                except CorruptRecord as exc:
                    log.error("%s (skipped)", exc)
                    found.append(None)
        return found

    def _scan(self, pattern: str) -> list[str]:
        """Keys matching `pattern`, at most `max_listed`."""
        keys: list[str] = []
        with self._errors():
            for key in self._redis.scan_iter(match=pattern, count=_PAGE):
                keys.append(key.decode())
                if len(keys) >= self._max_listed:
                    log.warning("listing %s stopped at %d keys", pattern, self._max_listed)
                    break
        return keys

    def _members(self, key: str) -> list[str]:
        """Members of a set, at most `max_listed`."""
        members: list[str] = []
        with self._errors():
            for member in self._redis.sscan_iter(key, count=_PAGE):
                members.append(member.decode())
                if len(members) >= self._max_listed:
                    log.warning("listing %s stopped at %d members", key, self._max_listed)
                    break
        return members

    # --- sessions
    def put_session(self, record: SessionRecord) -> None:
        """Also kept: the set of running sessions (the reapers' walk) and of the sandbox
        handles records name (the orphan sweep's)."""
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self._key("session", record.id), record.model_dump_json())
            pipe.sadd(self._key("owner-sessions", record.owner), record.id)
            if record.state == "running":
                pipe.sadd(self._key("running"), record.id)
            else:
                pipe.srem(self._key("running"), record.id)
            if record.sandbox_handle is not None:
                pipe.sadd(self._key("handles"), record.sandbox_handle)
            pipe.execute()

    def update_session(self, record: SessionRecord) -> bool:
        """Write the record only if it still exists (never bring back one another replica
        deleted); whether it did."""
        with self._errors():
            key = self._key("session", record.id)
            return bool(self._update(keys=[key], args=[record.model_dump_json()]))

    def get_session(self, session_id: str) -> SessionRecord | None:
        key = self._key("session", session_id)
        with self._errors():
            raw = cast(bytes | None, self._redis.get(key))
        return self._load(SessionRecord, raw, key)

    def delete_session(self, session_id: str) -> None:
        key = self._key("session", session_id)
        try:
            record = self.get_session(session_id)
        except CorruptRecord:
            record = None  # deleted all the same; its owner's index forgets it when listed
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.srem(self._key("running"), session_id)
            if record is not None:
                pipe.srem(self._key("owner-sessions", record.owner), session_id)
                if record.sandbox_handle is not None:
                    pipe.srem(self._key("handles"), record.sandbox_handle)
            pipe.execute()

    def sessions(
        self,
        *,
        owner: str | None = None,
        state: SessionState | None = None,
        backend: str | None = None,
        before: float | None = None,
    ) -> list[SessionRecord]:
        if owner is not None:
            ids = self._members(self._key("owner-sessions", owner))
            keys = [self._key("session", i) for i in ids]
        else:
            keys = self._scan(self._key("session", "*"))
        found = [
            r
            for r in self._load_many(SessionRecord, keys)
            if (owner is None or r.owner == owner)
            and (state is None or r.state == state)
            and (backend is None or r.backend == backend)
            and (before is None or r.state_since < before)
        ]
        return sorted(found, key=lambda r: r.state_since)

    def count_sessions(self, owner: str, state: SessionState) -> int:
        return len(self.sessions(owner=owner, state=state))

    def scan_sessions(self, cursor: int, count: int) -> tuple[int, list[SessionRecord]]:
        """One step of a walk over the running sessions (their set, not every key): (the next
        cursor, 0 when the walk is done; about `count` records). A reaper walks a bounded piece
        per round this way. Ids whose record is gone leave the set."""
        running = self._key("running")
        with self._errors():
            cursor, members = self._redis.sscan(running, cursor=cursor, count=count)
        ids = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        keys = [self._key("session", i) for i in ids]
        records = self._load_each(SessionRecord, keys)
        unread = [i for i, r in zip(ids, records, strict=True) if r is None]
        if unread:  # missing, or corrupt (kept: a corrupt record still exists)
            with self._errors():
                pipe = self._redis.pipeline(transaction=False)
                for i in unread:
                    pipe.exists(self._key("session", i))
                missing = [i for i, n in zip(unread, pipe.execute(), strict=True) if not n]
                if missing:
                    self._redis.srem(running, *missing)
        return int(cursor), [r for r in records if r is not None]

    def handles_named(self, handles: list[str]) -> set[str]:
        """Which of these sandbox handles a session record names (asked of the set every
        record's handle is kept in, so never cut short like a listing)."""
        named: set[str] = set()
        key = self._key("handles")
        for start in range(0, len(handles), _PAGE):
            page = handles[start : start + _PAGE]
            with self._errors():
                found = cast(list[int], self._redis.smismember(key, page))
            named |= {h for h, yes in zip(page, found, strict=True) if yes}
        return named

    # --- admission under the caps, shared by every replica
    def admit(self, owner: str, session_id: str, per_key: int, total: int) -> str | None:
        """Reserve a place for a session about to be made: None, or why it cannot (which cap,
        how many). Reserving an id twice is one reservation."""
        slot = Slot(owner=owner, at=time.time()).model_dump_json()
        with self._errors():
            answer = self._admit(
                keys=[
                    self._key("slots"),
                    self._key("owner-slots", owner),
                    self._key("slot-details"),
                ],
                args=[session_id, per_key, total, slot],
            )
        verdict = answer.decode() if isinstance(answer, bytes) else str(answer)
        if verdict == "ok":
            return None
        which, _, count = verdict.partition(":")
        if which == "total":
            return (
                f"the service holds its maximum of {total} sessions ({count} across its "
                "replicas); close one or try again later"
            )
        return f"this API key holds its maximum of {per_key} sessions ({count}); delete one first"

    def release(self, session_id: str) -> None:
        """Give a session's place back (it ended, or was never made). Idempotent."""
        details = self._key("slot-details")
        with self._errors():
            raw = cast(bytes | None, self._redis.hget(details, session_id))
        slot = None
        try:
            slot = self._load(Slot, raw, f"{details}[{session_id}]")
        except CorruptRecord as exc:
            log.error("%s (released all the same)", exc)
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.srem(self._key("slots"), session_id)
            if slot is not None:
                pipe.srem(self._key("owner-slots", slot.owner), session_id)
            pipe.hdel(details, session_id)
            pipe.execute()

    def slots_held(self, owner: str | None = None) -> int:
        """How many places are taken: in total, or by one owner."""
        key = self._key("owner-slots", owner) if owner is not None else self._key("slots")
        with self._errors():
            return int(self._redis.scard(key))

    def abandoned_slots(self, older_than_s: float, most: int) -> list[str]:
        """Places reserved over `older_than_s` ago whose session has no record: a replica died
        between reserving and recording. At most `most`."""
        cutoff = time.time() - older_than_s
        found: list[str] = []
        details = self._key("slot-details")
        old: list[str] = []
        with self._errors():
            for sid_raw, raw in self._redis.hscan_iter(details, count=_PAGE):
                sid = sid_raw.decode()
                try:
                    slot = self._load(Slot, raw, f"{details}[{sid}]")
                except CorruptRecord:
                    slot = None
                if slot is None or slot.at < cutoff:
                    old.append(sid)
                if len(old) >= self._max_listed:
                    break
            for start in range(0, len(old), _PAGE):  # one round trip per page, not per slot
                page = old[start : start + _PAGE]
                pipe = self._redis.pipeline(transaction=False)
                for sid in page:
                    pipe.exists(self._key("session", sid))
                found += [sid for sid, n in zip(page, pipe.execute(), strict=True) if not n]
                if len(found) >= most:
                    break
        return found[:most]

    # --- ends: once across replicas, and remembered by all
    def end(self, session_id: str, owner: str, why: str) -> tuple[bool, str]:
        """End a session in the store, once whichever replicas ask: the claim, the tombstone
        (every replica answers "ended, why" from now on) and its place given back, in one
        atomic step. Returns (whether this caller won, why it ended as the tombstone says)."""
        value = Tombstone(owner=owner, why=why).model_dump_json()
        with self._errors():
            answer = self._end(
                keys=[
                    self._key("claim", session_id),
                    self._key("ended", session_id),
                    self._key("slots"),
                    self._key("owner-slots", owner),
                    self._key("slot-details"),
                ],
                args=[session_id, value, self._claim_ttl, self._ttl],
            )
        raw = answer if isinstance(answer, bytes) else str(answer).encode()
        if raw == b"won":
            return True, why
        try:
            found = self._load(Tombstone, raw or None, self._key("ended", session_id))
        except CorruptRecord as exc:
            log.error("%s (ended all the same)", exc)
            found = None
        return False, found.why if found is not None else why

    def ended(self, session_id: str) -> tuple[str, str] | None:
        """(owner, why) of an ended session, or None."""
        key = self._key("ended", session_id)
        with self._errors():
            raw = cast(bytes | None, self._redis.get(key))
        found = self._load(Tombstone, raw, key)
        return (found.owner, found.why) if found is not None else None

    def ended_among(self, session_ids: list[str]) -> dict[str, tuple[str, str]]:
        """Which of these sessions ended: id -> (owner, why). Corrupt tombstones are skipped."""
        keys = [self._key("ended", i) for i in session_ids]
        return {
            key.rsplit(":", 1)[1]: (found.owner, found.why)
            for key, found in zip(keys, self._load_each(Tombstone, keys), strict=True)
            if found is not None
        }

    # --- snapshots
    def files_of(self, snapshot_id: str) -> Path:
        if not snapshot_id.replace("-", "").isalnum():  # ids are made here; never a path
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self._files / snapshot_id

    def put_snapshot(self, record: SnapshotRecord) -> None:
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self._key("snapshot", record.id), record.model_dump_json())
            pipe.sadd(self._key("owner-snapshots", record.owner), record.id)
            pipe.execute()

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        key = self._key("snapshot", snapshot_id)
        with self._errors():
            raw = cast(bytes | None, self._redis.get(key))
        return self._load(SnapshotRecord, raw, key)

    def delete_snapshot(self, snapshot_id: str) -> None:
        try:
            record = self.get_snapshot(snapshot_id)
        except CorruptRecord:
            record = None
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._key("snapshot", snapshot_id))
            if record is not None:
                pipe.srem(self._key("owner-snapshots", record.owner), snapshot_id)
            pipe.execute()
        shutil.rmtree(self.files_of(snapshot_id), ignore_errors=True)

    def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        if owner is not None:
            ids = self._members(self._key("owner-snapshots", owner))
            keys = [self._key("snapshot", i) for i in ids]
        else:
            keys = self._scan(self._key("snapshot", "*"))
        found = [
            r
            for r in self._load_many(SnapshotRecord, keys)
            if (owner is None or r.owner == owner)
            and (kind is None or r.kind == kind)
            and (session_id is None or r.session_id == session_id)
        ]
        return sorted(found, key=lambda r: r.created_at, reverse=True)

    def usage(self, owner: str) -> tuple[int, int]:
        mine = self.snapshots(owner=owner)
        return sum(1 for r in mine if r.kind == "snapshot"), sum(r.bytes for r in mine)

    def orphan_files(self) -> list[Path]:
        """Saved states' directories no record names (a crash between writing and recording).
        Each directory is asked about by name, never against a listing that may be cut short."""
        dirs = list(self._files.iterdir())
        orphans: list[Path] = []
        for start in range(0, len(dirs), _PAGE):
            page = dirs[start : start + _PAGE]
            with self._errors():
                pipe = self._redis.pipeline(transaction=False)
                for d in page:
                    pipe.exists(self._key("snapshot", d.name))
                orphans += [d for d, n in zip(page, pipe.execute(), strict=True) if not n]
        return orphans
