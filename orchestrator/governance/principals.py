"""Who a key is: the keys the settings name (full access; `admin_keys` admins too) and the keys
`code-interpreter keys add` keeps in the store (hashed, each with a policy).

Every lookup is answered from memory, so no request waits on the store: the store's principals
are read again about once a second (awaited; the store never holds the event loop), which is
how a key added, rotated or revoked by the CLI (another process, or another replica) takes
effect without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field

from orchestrator.governance.policy import FULL_ACCESS, Principal
from orchestrator.governance.stores.principal_store import PrincipalRecord, PrincipalStore
from orchestrator.settings_sections import AuthSection

log = logging.getLogger(__name__)

LOCAL_OWNER = "local"  # the one owner when auth is explicitly disabled
KEY_PREFIX = "cir_"  # keys made by the CLI: easy to spot in a leaked file or a scanner
REFRESH_S = 1.0  # how stale the store's principals may be here
NO_KEYS_YET = (
    "this service has no API key yet: its operator adds one with `code-interpreter keys add "
    "NAME --admin` (beside the running service: it takes it within a second), or sets "
    "CODE_INTERPRETER_API_KEYS"
)


def owner_of(key: str) -> str:
    """The owner id of a key the settings name (records were stored under it before keys had
    names, and still are)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def digest_of(key: str) -> str:
    """How a key made by the CLI is kept: its SHA-256, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()


E2B_KEY_PREFIX = "e2b_"  # E2B's shape: `e2b_` and 40 hex digits (160 random bits)


def new_key(*, e2b_shaped: bool = False) -> str:
    """A new key: ours (`cir_`, 256 random bits), or shaped as E2B's for clients that check a
    key's shape before sending it (E2B's SDKs before 2.x's last releases, tools built on them)."""
    if e2b_shaped:
        return E2B_KEY_PREFIX + secrets.token_hex(20)
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_principal_id() -> str:
    return "p_" + secrets.token_hex(8)


def settings_name(owner: str) -> str:
    """The name of a key the settings name: it has none of its own."""
    return f"key-{owner[:8]}"


def principal_of(record: PrincipalRecord) -> Principal:
    return Principal(id=record.id, name=record.name, admin=record.admin, policy=record.policy)


@dataclass
class _Known:
    """The store's principals as last read: by key digest, by id, and which are revoked."""

    by_digest: dict[str, PrincipalRecord] = field(default_factory=dict)
    by_id: dict[str, Principal] = field(default_factory=dict)
    revoked: dict[str, float] = field(default_factory=dict)  # id -> when
    live: dict[str, PrincipalRecord] = field(default_factory=dict)  # not revoked, by id

    @staticmethod
    def of(records: list[PrincipalRecord]) -> _Known:
        known = _Known()
        for record in records:
            known.by_id[record.id] = principal_of(record)
            if record.revoked_at is not None:
                known.revoked[record.id] = record.revoked_at
                continue
            known.live[record.id] = record
            for key in record.keys:
                known.by_digest[key.digest] = record
        return known


class Principals:
    """`Admission.principals`: authenticate a key, and say who an owner id is."""

    def __init__(
        self, settings: AuthSection, store: PrincipalStore | None, refresh_s: float = REFRESH_S
    ) -> None:
        self.disabled = settings.auth_disabled
        self._store = store
        self._refresh_s = refresh_s
        # The settings' keys (and their digests), each with its principal; compared in
        # constant time.
        self._settings_keys: list[tuple[bytes, Principal]] = []
        self._settings_digests: list[tuple[bytes, Principal]] = []
        self._settings_ids: dict[str, Principal] = {}
        for key, admin in [(k, False) for k in settings.api_keys] + [
            (k, True) for k in settings.admin_keys
        ]:
            owner = owner_of(key)
            principal = Principal(id=owner, name=settings_name(owner), admin=admin)
            if admin or owner not in self._settings_ids:  # listed in both: an admin
                self._settings_ids[owner] = principal
            self._settings_keys.append((key.encode(), principal))
            self._settings_digests.append((digest_of(key).encode(), principal))
        self._local = Principal(id=LOCAL_OWNER, name=LOCAL_OWNER, admin=True)
        self._known = _Known()
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    # --- the store's principals, read again and again
    async def reload(self) -> None:
        """Read the store's principals now."""
        if self._store is None:
            return
        self._known = _Known.of(await self._store.principals())

    async def start(self) -> None:
        """Read the store once (a store that fails stops the start), then keep reading it."""
        await self.reload()
        if not self.disabled and not self.has_keys:
            log.warning("%s; until then every request answers 401", NO_KEYS_YET)
        if self._store is not None:
            self._task = asyncio.ensure_future(self._refresh_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.reload()
            except Exception as exc:  # what was read last holds until the store answers again
                if not self._failing:
                    log.warning("reading the keys from the store failed (kept the last): %s", exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("reading the keys from the store works again")
                self._failing = False

    # --- who a key is
    def authenticate(self, key: str) -> Principal | None:
        """The principal of a key, or None (unknown, revoked, or past its rotation's grace)."""
        if self.disabled:
            return self._local
        key = key.strip()
        if not key:
            return None
        found = self._settings_match(self._settings_keys, key.encode())
        return found if found is not None else self._stored(digest_of(key))

    def authenticate_digest(self, digest: str) -> Principal | None:
        """The principal of the key whose SHA-256 hex this is, as `authenticate` answers for
        the key: for a login that kept the digest, never the key (the console's)."""
        if self.disabled:
            return self._local
        if not digest:
            return None
        found = self._settings_match(self._settings_digests, digest.encode())
        return found if found is not None else self._stored(digest)

    def _settings_match(
        self, known: list[tuple[bytes, Principal]], given: bytes
    ) -> Principal | None:
        found: Principal | None = None
        for value, principal in known:  # every one compared: timing tells nothing
            if hmac.compare_digest(given, value) and found is None:
                found = principal
        return self._settings_ids[found.id] if found is not None else None

    def _stored(self, digest: str) -> Principal | None:
        """The store's principal holding this key digest, unless revoked or past its grace."""
        record = self._known.by_digest.get(digest)
        if record is None:
            return None
        now = time.time()
        for held in record.keys:
            if held.digest == digest and (held.expires_at is None or held.expires_at > now):
                return self._known.by_id[record.id]
        return None

    @property
    def has_keys(self) -> bool:
        """Whether any key can authenticate at all (the settings', or a live one the CLI
        made); a service without one answers every request 401 until one is added."""
        return bool(self._settings_keys) or bool(self._known.by_digest)

    def of(self, owner: str) -> Principal:
        """Who an owner id is, never raising: one that is no longer known (a key taken out of
        the settings) is full access under a name cut from its id."""
        if owner == LOCAL_OWNER and self.disabled:
            return self._local
        found = self._settings_ids.get(owner) or self._known.by_id.get(owner)
        if found is not None:
            return found
        return Principal(id=owner, name=owner[:12], policy=FULL_ACCESS)

    def is_revoked(self, owner: str) -> bool:
        """Whether this owner id is a revoked key's (as last read from the store): its
        sessions do nothing more, even before the reaper has ended them."""
        return owner in self._known.revoked

    def is_current(self, owner: str) -> bool:
        """Whether this owner id is a key's that works now (as last read from the store): one
        the settings name, or the store's, not revoked, with a key not past its grace. What was
        given to an owner that is not (a volume token) opens nothing."""
        if self.disabled:
            return owner == LOCAL_OWNER
        if owner in self._settings_ids:
            return True
        record = self._known.live.get(owner)
        now = time.time()
        return record is not None and any(
            k.expires_at is None or k.expires_at > now for k in record.keys
        )

    def revoked(self) -> dict[str, float]:
        """Revoked principals' ids, with when (as last read from the store)."""
        return dict(self._known.revoked)

    def by_name(self, name: str) -> Principal | None:
        """A principal by its name (an admin's filter), among those known here."""
        for principal in [*self._settings_ids.values(), *self._known.by_id.values()]:
            if principal.name == name:
                return principal
        return None
