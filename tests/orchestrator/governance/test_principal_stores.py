"""Keys as principals in both stores (SQLite under the state dir, a real redis-server), and
`Principals`, which answers who a key is from memory and reads the store again each second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from orchestrator.config import Settings
from orchestrator.governance.policy import FULL_ACCESS, Policy
from orchestrator.governance.principals import (
    LOCAL_OWNER,
    Principals,
    digest_of,
    new_key,
    new_principal_id,
    owner_of,
)
from orchestrator.governance.stores.audit_store import AuditQuery
from orchestrator.governance.stores.principal_store import (
    KeyDigest,
    PrincipalNameTaken,
    PrincipalRecord,
    PrincipalStore,
)
from orchestrator.settings_sections import AuthSection
from tests.orchestrator.governance.store_handles import StoreHandle, local_store, shared_store

SETTINGS_KEY, ADMIN_KEY = "settings-key-" + new_key(), "admin-key-" + new_key()


@pytest.fixture
def two_stores(
    store_pair: tuple[StoreHandle, StoreHandle],
) -> tuple[PrincipalStore, PrincipalStore]:
    """Two handles on one store, as the service and the CLI (or two replicas) hold."""
    return store_pair[0].principals, store_pair[1].principals


def record(name: str, *keys: str, **fields: object) -> PrincipalRecord:
    return PrincipalRecord.model_validate(
        {
            "id": new_principal_id(),
            "name": name,
            "keys": [KeyDigest(digest=digest_of(k)) for k in keys],
            **fields,
        }
    )


async def test_principals_round_trip_and_a_rotation_drops_the_old_digest(
    two_stores: tuple[PrincipalStore, PrincipalStore],
) -> None:
    mine, theirs = two_stores
    old, new = new_key(), new_key()
    analyst = record("analyst", old, policy=Policy(backends=["local"]))
    await mine.put_principal(analyst)
    await mine.put_principal(record("admin", new_key(), admin=True))
    assert await theirs.get_principal("analyst") == analyst
    assert await theirs.principal_by_id(analyst.id) == analyst
    assert await theirs.principal_by_digest(digest_of(old)) == analyst
    assert [r.name for r in await theirs.principals()] == ["admin", "analyst"]
    assert (
        await theirs.get_principal("nobody") is None and await theirs.principal_by_id("p_x") is None
    )
    rotated = analyst.model_copy(update={"keys": [KeyDigest(digest=digest_of(new))]})
    await theirs.put_principal(rotated)
    assert await mine.principal_by_digest(digest_of(old)) is None
    assert await mine.principal_by_digest(digest_of(new)) == rotated
    assert len(await mine.principals()) == 2


async def test_a_name_is_never_taken_over(
    two_stores: tuple[PrincipalStore, PrincipalStore],
) -> None:
    mine, theirs = two_stores
    key = new_key()
    first = record("analyst", key)
    await mine.put_principal(first)
    with pytest.raises(PrincipalNameTaken):
        await theirs.put_principal(record("analyst", new_key()))
    assert await theirs.get_principal("analyst") == first  # untouched, key and all
    assert await theirs.principal_by_digest(digest_of(key)) == first
    assert len(await theirs.principals()) == 1


def settings(tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "api_keys": [SETTINGS_KEY],
        "admin_keys": [ADMIN_KEY],
        "state_dir": tmp_path / "state",
        **overrides,
    }
    return Settings.model_validate(values)


@pytest.fixture
async def store_and_principals(tmp_path: Path) -> AsyncIterator[tuple[StoreHandle, Principals]]:
    store = local_store(tmp_path / "state")
    principals = Principals(AuthSection.of(settings(tmp_path)), store.principals, refresh_s=0.05)
    await principals.start()
    yield store, principals
    await principals.close()
    await store.close()


async def soon(check: object, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.02)
    return False


async def test_settings_keys_are_full_access_and_admin_keys_admins(
    store_and_principals: tuple[StoreHandle, Principals],
) -> None:
    _, principals = store_and_principals
    plain = principals.authenticate(f"  {SETTINGS_KEY} ")
    assert plain is not None and plain.id == owner_of(SETTINGS_KEY)
    assert plain.name == f"key-{owner_of(SETTINGS_KEY)[:8]}" and not plain.admin
    assert plain.policy == FULL_ACCESS
    admin = principals.authenticate(ADMIN_KEY)
    assert admin is not None and admin.admin and admin.policy == FULL_ACCESS
    assert principals.of(owner_of(ADMIN_KEY)) == admin
    for wrong in ("", "   ", SETTINGS_KEY + "x", SETTINGS_KEY[:-1], new_key()):
        assert principals.authenticate(wrong) is None
    # An owner no key names any more (a key taken out of the settings): full access, a name.
    gone = principals.of("0123456789abcdef01234567")
    assert gone.name == "0123456789ab" and gone.policy == FULL_ACCESS and not gone.admin


async def test_store_keys_added_rotated_and_revoked_take_effect_within_the_refresh(
    store_and_principals: tuple[StoreHandle, Principals],
) -> None:
    store, principals = store_and_principals
    old, new = new_key(), new_key()
    analyst = record("analyst", old, policy=Policy(commands=False))
    await store.principals.put_principal(analyst)
    assert await soon(lambda: principals.authenticate(old) is not None)
    found = principals.authenticate(old)
    assert found is not None and found.id == analyst.id and found.name == "analyst"
    assert found.policy.commands is False and principals.of(analyst.id) == found
    # Rotated with a grace period that has passed: the old key no longer works.
    past = KeyDigest(digest=digest_of(old), expires_at=time.time() - 1)
    await store.principals.put_principal(
        analyst.model_copy(update={"keys": [past, KeyDigest(digest=digest_of(new))]})
    )
    assert await soon(lambda: principals.authenticate(new) is not None)
    assert principals.authenticate(old) is None
    # Revoked: no key works; it is listed as revoked; its owner id still has its name.
    await store.principals.put_principal(analyst.model_copy(update={"revoked_at": time.time()}))
    assert await soon(lambda: principals.authenticate(new) is None)
    assert analyst.id in principals.revoked()
    assert principals.of(analyst.id).name == "analyst"
    assert principals.by_name("analyst") is not None and principals.by_name("nobody") is None


async def test_without_auth_every_caller_is_the_local_admin(tmp_path: Path) -> None:
    principals = Principals(
        AuthSection.of(settings(tmp_path, api_keys=[], auth_disabled=True)), None
    )
    await principals.start()
    local = principals.authenticate("")
    assert local is not None and local.id == LOCAL_OWNER and local.admin
    assert principals.of(LOCAL_OWNER) == local
    await principals.close()


async def test_the_cli_writes_the_clusters_store(redis_url: str, tmp_path: Path) -> None:
    """`--store redis://...`: the keys every replica reads."""
    runner = CliRunner()

    async def keys(*args: str) -> tuple[int, str, str]:
        done = await asyncio.to_thread(  # the CLI runs an event loop of its own
            runner.invoke,
            cli_app,
            ["keys", *args, "--store", redis_url, "--state-dir", str(tmp_path)],
        )
        return done.exit_code, done.stdout, done.stderr

    code, out, err = await keys(
        "add", "cluster-analyst", "--backends", "ray", "--max-sessions", "2"
    )
    assert code == 0, err
    key = out.strip()
    store = shared_store(redis_url, prefix="cir", snapshots_dir=tmp_path / "snaps")
    try:
        found = await store.principals.principal_by_digest(digest_of(key))
        assert found is not None and found.name == "cluster-analyst"
        assert found.policy.backends == ["ray"] and found.policy.max_sessions == 2
        code, out, err = await keys("list")
        assert code == 0 and "cluster-analyst" in out and key[4:] not in out
        code, out, err = await keys("revoke", "cluster-analyst")
        assert code == 0, err
        revoked = await store.principals.get_principal("cluster-analyst")
        assert revoked is not None and revoked.revoked_at is not None and revoked.keys == []
        assert await store.principals.principal_by_digest(digest_of(key)) is None
        events = await store.audit.query_events(AuditQuery())
        assert [e.kind for e in events if e.principal == "cluster-analyst"] == [
            "key.revoked",
            "key.added",
        ]
    finally:
        await store.close()
    wrong = runner.invoke(cli_app, ["keys", "list", "--store", "http://nowhere"])
    assert wrong.exit_code == 2 and "--store must be redis://" in wrong.stderr
