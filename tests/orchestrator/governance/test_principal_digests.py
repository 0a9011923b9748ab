"""`Principals.authenticate_digest`: who a key is known by its digest alone (the console's
login keeps the digest, never the key), with the same answers as `authenticate` for the key:
a settings key while the settings name it, a CLI key while it is not revoked nor expired."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.governance.principals import Principals, digest_of, new_key, owner_of
from orchestrator.governance.stores.principal_store import KeyDigest, PrincipalRecord
from orchestrator.settings_sections import AuthSection
from tests.orchestrator.governance.store_handles import local_store

pytestmark = pytest.mark.unit


async def test_a_digest_authenticates_as_its_key_does(tmp_path: Path) -> None:
    settings_key, admin_key = "plain-" + new_key(), "boss-" + new_key()
    settings = Settings(api_keys=[settings_key], admin_keys=[admin_key], state_dir=tmp_path)
    store = local_store(tmp_path)
    try:
        live, old, gone = new_key(), new_key(), new_key()
        now = time.time()
        await store.principals.put_principal(
            PrincipalRecord(
                id="p_live",
                name="alice",
                keys=[
                    KeyDigest(digest=digest_of(live)),
                    KeyDigest(digest=digest_of(old), expires_at=now - 1),  # its grace is over
                ],
            )
        )
        await store.principals.put_principal(
            PrincipalRecord(
                id="p_gone", name="bob", keys=[KeyDigest(digest=digest_of(gone))], revoked_at=now
            )
        )
        principals = Principals(AuthSection.of(settings), store.principals)
        await principals.reload()
        for key in (settings_key, admin_key, live, old, gone, "never-made"):
            by_key = principals.authenticate(key)
            assert principals.authenticate_digest(digest_of(key)) == by_key, key
        plain = principals.authenticate_digest(digest_of(settings_key))
        assert plain is not None and plain.id == owner_of(settings_key) and not plain.admin
        boss = principals.authenticate_digest(digest_of(admin_key))
        assert boss is not None and boss.admin
        alice = principals.authenticate_digest(digest_of(live))
        assert alice is not None and alice.id == "p_live"
        assert principals.authenticate_digest(digest_of(old)) is None
        assert principals.authenticate_digest(digest_of(gone)) is None
        assert principals.authenticate_digest("") is None
        assert principals.authenticate_digest("x" * 10_000) is None
    finally:
        await store.close()


def test_with_auth_off_any_digest_is_the_local_admin(tmp_path: Path) -> None:
    principals = Principals(AuthSection.of(Settings(auth_disabled=True, state_dir=tmp_path)), None)
    found = principals.authenticate_digest("")
    assert found is not None and found.id == "local" and found.admin
