"""The vault's parts without a sandbox: both stores (SQLite, and Redis as a cluster shares it),
the sealing (a value opens only as its owner's secret of its name), the key and CA files, and
what a cluster without its shared key and CA says."""

from __future__ import annotations

import asyncio
import base64
import secrets
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.secrets import StoreSecretRequest
from orchestrator.vault.ca import load_ca
from orchestrator.vault.crypto import Sealer, load_key
from orchestrator.vault.records import (
    SecretBinding,
    SecretNotFound,
    SecretRecord,
    SecretsFull,
    SecretsNotAvailable,
    VaultSettingError,
    VaultUnavailable,
)
from orchestrator.vault.sqlite_store import SqliteVault
from orchestrator.vault.store import VaultStore
from orchestrator.vault.vault import Vault, VaultSection, unreachable

VALUE = "tok-" + secrets.token_hex(16)
BINDING = SecretBinding(hosts=["api.example.com"])


def record(owner: str, name: str, sealer: Sealer, value: str = VALUE) -> SecretRecord:
    nonce, ciphertext = sealer.seal(owner, name, BINDING, value)
    return SecretRecord(
        owner=owner, name=name, hosts=["api.example.com"], nonce=nonce, ciphertext=ciphertext
    )


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[VaultStore]:
    if request.param == "sqlite":
        kept: VaultStore = SqliteVault(tmp_path)
        yield kept
        await kept.close()
        return
    from orchestrator.state_store.redis_connection import RedisConnection
    from orchestrator.vault.redis_store import RedisVault

    connection = RedisConnection(
        request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex[:10]}"
    )
    yield RedisVault(connection)
    await connection.close()


async def test_a_store_keeps_each_owners_secrets_apart_and_caps_them(store: VaultStore) -> None:
    sealer = Sealer(secrets.token_bytes(32))
    assert await store.put(record("a", "ONE", sealer), 2) is False
    first = await store.get("a", "ONE")
    assert first is not None
    assert await store.put(record("a", "ONE", sealer, "new"), 2) is True  # replaced
    again = await store.get("a", "ONE")
    assert again is not None and again.created_at == first.created_at
    assert sealer.open("a", "ONE", again.binding, again.nonce, again.ciphertext) == "new"
    await store.put(record("a", "TWO", sealer), 2)
    with pytest.raises(SecretsFull):
        await store.put(record("a", "THREE", sealer), 2)
    await store.put(record("a", "ONE", sealer), 2)  # a replacement is not one more
    await store.put(record("b", "ONE", sealer), 2)  # another owner's cap is its own
    assert [r.name for r in await store.owned("a")] == ["ONE", "TWO"]
    assert [r.name for r in await store.owned("b")] == ["ONE"]
    assert await store.get("b", "TWO") is None
    assert await store.delete("a", "ONE") is True
    assert await store.delete("a", "ONE") is False
    assert await store.get("b", "ONE") is not None


async def test_replacements_at_once_keep_the_first_records_creation_time(
    store: VaultStore,
) -> None:
    """Replicas storing one name at once: whichever was stored first is the one created, and its
    time is kept to the last bit by every replacement."""
    sealer = Sealer(secrets.token_bytes(32))
    made = [
        record("a", "RACED", sealer, f"v{n}").model_copy(
            update={"created_at": 1_764_432_000.123_456_7 + n / 1_000_003}
        )
        for n in range(8)
    ]
    replaced = await asyncio.gather(*(store.put(r, 10) for r in made))
    assert sorted(replaced) == [False] + [True] * 7
    first = made[replaced.index(False)]
    kept = await store.get("a", "RACED")
    assert kept is not None and kept.created_at == first.created_at
    assert await store.put(record("a", "RACED", sealer), 10) is True
    again = await store.get("a", "RACED")
    assert again is not None and again.created_at == first.created_at
    assert again.updated_at != first.updated_at or again.nonce != first.nonce
    # A record gone bad at rest is replaced (with the new time), not in the way for good.
    if isinstance(store, SqliteVault):
        with store._lock:
            store._db.execute("UPDATE secrets SET doc = '{not json' WHERE name = 'RACED'")
    else:
        from orchestrator.vault.redis_store import RedisVault

        assert isinstance(store, RedisVault)
        await store._redis.hset(store._key("vault", "a"), "RACED", "{not json")
    assert await store.put(record("a", "RACED", sealer), 10) is True
    assert await store.get("a", "RACED") is not None


def test_a_sealed_value_opens_only_for_its_owner_name_and_binding() -> None:
    sealer = Sealer(secrets.token_bytes(32))
    nonce, ciphertext = sealer.seal("a", "ONE", BINDING, VALUE)
    assert VALUE not in base64.b64decode(ciphertext).decode(errors="replace")
    assert sealer.open("a", "ONE", BINDING, nonce, ciphertext) == VALUE
    for owner, name in (("b", "ONE"), ("a", "TWO")):
        with pytest.raises(VaultUnavailable):
            sealer.open(owner, name, BINDING, nonce, ciphertext)
    with pytest.raises(VaultUnavailable):
        Sealer(secrets.token_bytes(32)).open("a", "ONE", BINDING, nonce, ciphertext)
    # Its binding changed at rest (by whoever can write the store but has no key): no value.
    for changed in (
        {"hosts": ["evil.example"]},
        {"hosts": ["api.example.com", "evil.example"]},
        {"methods": ["GET"]},
        {"path_prefixes": ["/"]},
        {"headers": ["authorization", "x-echo"]},
    ):
        moved = BINDING.model_copy(update=changed)
        with pytest.raises(VaultUnavailable, match="ONE"):
            sealer.open("a", "ONE", moved, nonce, ciphertext)


def test_the_key_is_made_once_private_or_given_and_required_in_a_cluster(tmp_path: Path) -> None:
    made = load_key(None, tmp_path, clustered=False)
    assert stat.S_IMODE((tmp_path / "vault.key").stat().st_mode) == 0o600
    assert load_key(None, tmp_path, clustered=False) == made  # kept across starts
    given = secrets.token_bytes(32)
    assert load_key(base64.b64encode(given).decode(), tmp_path, clustered=True) == given
    with pytest.raises(VaultUnavailable, match="vault_key"):
        load_key(None, tmp_path / "other", clustered=True)
    with pytest.raises(ValueError, match="32 bytes"):
        load_key(base64.b64encode(b"short").decode(), tmp_path, clustered=False)


def section(state_dir: Path, **more: Any) -> VaultSection:
    values: dict[str, Any] = {
        "state_dir": state_dir,
        "key": None,
        "ca_cert_file": None,
        "ca_key_file": None,
        "max_secrets_per_key": 10,
        "clustered": False,
    }
    return VaultSection(**(values | more))


async def test_a_cluster_without_its_shared_key_and_ca_says_what_to_set(tmp_path: Path) -> None:
    events: list[Any] = []
    vault = Vault(section(tmp_path, clustered=True), lambda *e: events.append(e))
    await vault.start()  # the service runs; the vault answers why it cannot
    with pytest.raises(VaultUnavailable, match="vault_key"):
        await vault.list("a")
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    vault = Vault(section(tmp_path, clustered=True, key=key), lambda *e: events.append(e))
    await vault.start()
    with pytest.raises(VaultUnavailable, match="vault_ca_cert_file"):
        await vault.list("a")


async def test_the_vault_binds_by_name_and_audits_without_values(tmp_path: Path) -> None:
    events: list[tuple[Any, ...]] = []
    vault = Vault(section(tmp_path), lambda *e: events.append(e))
    await vault.start()
    try:
        request = StoreSecretRequest(name="API_KEY", value=VALUE, hosts=["*.example.com"])
        info, replaced = await vault.put("a", request)
        assert (info.name, info.placeholder, replaced) == ("API_KEY", "cir-secret://API_KEY", False)
        policy = NetworkPolicy.model_validate(["*.example.com:443"])
        env = await vault.session_env("a", ["API_KEY"], policy)
        assert env["API_KEY"] == "cir-secret://API_KEY" and VALUE not in str(env)
        with pytest.raises(SecretsNotAvailable, match="API_KEY"):
            await vault.session_env("b", ["API_KEY"], policy)  # another key's: unknown
        assert info.headers == ["authorization", "x-api-key", "api-key"]  # the default
        bound = await vault.for_session("a", "s-1", ["API_KEY"])
        assert bound.bindings.names == ("API_KEY",) and VALUE not in repr(bound.bindings)
        trust = vault.trust
        assert trust is not None and b"BEGIN CERTIFICATE" in trust.ca_cert
        assert trust.bundle.endswith(trust.ca_cert)
        assert bound.interceptor.ca_cert_pem == trust.ca_cert
        vault.used("a", "s-1", "api.example.com", [("API_KEY", "substituted")])
        await vault.delete("a", "API_KEY")
        with pytest.raises(SecretNotFound):
            await vault.get("a", "API_KEY")
        # Deleted since: a resumed session is left without it, not refused.
        assert (await vault.for_session("a", "s-1", ["API_KEY"])).bindings.names == ()
    finally:
        await vault.close()
    kinds = [e[0] for e in events]
    assert kinds == ["secret.stored", "secret.used", "secret.deleted"]
    assert VALUE not in repr(events)


@pytest.mark.parametrize(
    ("policy", "hosts", "missing"),
    [
        ("any", ["api.example.com"], []),
        (["api.example.com:8443"], ["api.example.com"], []),
        (["*.example.com"], ["api.example.com", "*.example.com", "x.other"], ["x.other"]),
        (["api.example.com"], ["*.example.com"], ["*.example.com"]),
        ({"mode": "any", "deny": ["api.example.com:*"]}, ["api.example.com"], ["api.example.com"]),
        ("none", ["api.example.com"], ["api.example.com"]),
    ],
)
def test_a_binding_must_be_reachable_under_the_sessions_policy(
    policy: object, hosts: list[str], missing: list[str]
) -> None:
    assert unreachable(hosts, NetworkPolicy.model_validate(policy)) == missing


def test_the_ca_is_made_once_its_key_private_and_given_files_are_checked(tmp_path: Path) -> None:
    made = load_ca(tmp_path)
    assert stat.S_IMODE((tmp_path / "vault-ca.key").stat().st_mode) == 0o600
    assert load_ca(tmp_path) == made  # kept across starts
    assert made.bundle.endswith(made.cert_pem)
    assert made.bundle.count(b"BEGIN CERTIFICATE") > 1  # the system's CAs too
    with pytest.raises(VaultUnavailable, match="vault_ca_cert_file"):
        load_ca(tmp_path / "replica", clustered=True)
    other = load_ca(tmp_path / "other")
    (tmp_path / "mixed.crt").write_bytes(other.cert_pem)
    with pytest.raises(VaultSettingError, match="not its certificate"):
        load_ca(tmp_path, cert_file=tmp_path / "mixed.crt", key_file=tmp_path / "vault-ca.key")
    with pytest.raises(VaultSettingError, match="cannot be read"):
        load_ca(tmp_path, cert_file=tmp_path / "none.crt", key_file=tmp_path / "none.key")
    given = load_ca(
        tmp_path / "given",
        cert_file=tmp_path / "vault-ca.crt",
        key_file=tmp_path / "vault-ca.key",
        clustered=True,
    )
    assert given.cert_pem == made.cert_pem
