"""The vault's hardening, without a sandbox: a secret bound to the headers it may go in; no
wildcard over a public suffix or a hosting provider's domain; a binding changed at rest leaving
the secret unbound (never failing a resume); one bounded audit event per connection; no key in
a repr; key and CA files written whole, a damaged key refused, an expiring CA warned of."""

from __future__ import annotations

import base64
import datetime
import logging
import os
import re
import secrets
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.secrets import StoreSecretRequest
from orchestrator.durable_files import write_new
from orchestrator.vault.ca import load_ca
from orchestrator.vault.crypto import VaultKeyError, load_key
from orchestrator.vault.public_suffixes import StoreSecretBody
from orchestrator.vault.records import InvalidSecret, SecretsNotAvailable, VaultSettingError
from orchestrator.vault.sqlite_store import SqliteVault
from orchestrator.vault.vault import MAX_USES_AUDITED, Vault, VaultSection
from sandbox.egress.interception import generate_ca

VALUE = "tok-" + secrets.token_hex(16)
POLICY = NetworkPolicy.model_validate(["api.example.com:443"])


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


@pytest.fixture
async def vault(tmp_path: Path) -> AsyncIterator[tuple[Vault, list[tuple[Any, ...]]]]:
    events: list[tuple[Any, ...]] = []
    kept = Vault(section(tmp_path), lambda *e: events.append(e))
    await kept.start()
    try:
        yield kept, events
    finally:
        await kept.close()


def request(**more: Any) -> StoreSecretRequest:
    """The store request as the route takes it."""
    return StoreSecretBody.model_validate(
        {"name": "API_KEY", "value": VALUE, "hosts": ["api.example.com"]} | more
    )


# --- headers


async def test_a_secret_names_the_headers_it_may_go_in(
    vault: tuple[Vault, list[tuple[Any, ...]]],
) -> None:
    kept, _ = vault
    info, _ = await kept.put(
        "a", request(headers=["X-Goog-Api-Key", "authorization", "x-goog-api-key"])
    )
    assert info.headers == ["x-goog-api-key", "authorization"]  # lowercase, each once
    assert (await kept.get("a", "API_KEY")).headers == info.headers
    bound = await kept.for_session("a", "s-1", ["API_KEY"])
    swapped = bound.bindings.substitute(
        [(b"x-goog-api-key", b"cir-secret://API_KEY"), (b"x-echo", b"cir-secret://API_KEY")],
        host="api.example.com",
        method="GET",
        path="/",
    )
    assert swapped.headers == [
        (b"x-goog-api-key", VALUE.encode()),
        (b"x-echo", b"cir-secret://API_KEY"),
    ]


@pytest.mark.parametrize(
    "headers",
    [
        [],
        ["bad header"],
        ["x:y"],
        ["x" * 65],
        [f"x-{i}" for i in range(17)],
        ["Host"],
        ["content-length"],
        ["Transfer-Encoding"],
        ["proxy-authorization"],
    ],
)
def test_header_names_are_checked(headers: list[str]) -> None:
    with pytest.raises(ValidationError, match="headers"):
        request(headers=headers)


# --- wildcards


@pytest.mark.parametrize(
    "host",
    [
        "*.com",
        "*.co.uk",
        "*.amazonaws.com",
        "*.github.io",
        "*.herokuapp.com",
        "*.blob.core.windows.net",
        "*.s3.amazonaws.com",
        "*.test",
    ],
)
async def test_a_wildcard_over_a_shared_domain_is_refused_naming_it(
    vault: tuple[Vault, list[tuple[Any, ...]]], host: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        request(hosts=["api.example.com", host.upper()])
    assert host in str(refused.value)
    # Handed to the vault by another way than the route: refused there too.
    kept, _ = vault
    unchecked = StoreSecretRequest(name="API_KEY", value=VALUE, hosts=[host])
    with pytest.raises(InvalidSecret, match=re.escape(host)):
        await kept.put("a", unchecked)


@pytest.mark.parametrize(
    "host", ["*.example.com", "*.openai.azure.com", "*.corp.example.co.uk", "*.svc.cluster.local"]
)
def test_a_wildcard_over_ones_own_domain_is_taken(host: str) -> None:
    assert request(hosts=[host]).hosts == [host]


# --- the binding sealed in


async def test_a_binding_changed_at_rest_is_refused_to_new_sessions_and_unbound_on_resume(
    vault: tuple[Vault, list[tuple[Any, ...]]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, _ = vault
    await kept.put("a", request())
    await kept.put("a", request(name="OTHER_KEY"))
    # Whoever can write vault.db (not the key) points one secret at another host.
    store = SqliteVault(tmp_path)
    try:
        stored = await store.get("a", "API_KEY")
        assert stored is not None
        moved = stored.model_copy(update={"hosts": ["api.example.com", "evil.example"]})
        await store.put(moved, 10)
    finally:
        await store.close()
    with pytest.raises(SecretsNotAvailable, match="API_KEY"):
        await kept.session_env("a", ["API_KEY"], POLICY)
    with caplog.at_level(logging.WARNING):
        bound = await kept.for_session("a", "s-1", ["API_KEY", "OTHER_KEY"])
    assert bound.bindings.names == ("OTHER_KEY",)  # the resume goes on, without that one
    assert any("API_KEY" in r.getMessage() and "s-1" in r.getMessage() for r in caplog.records)
    # Stored again, it is sealed under its new binding and opens.
    await kept.put("a", request(hosts=["api.example.com", "other.example.com"]))
    assert (await kept.for_session("a", "s-1", ["API_KEY"])).bindings.names == ("API_KEY",)


async def test_a_changed_vault_key_leaves_secrets_unbound(tmp_path: Path) -> None:
    first = Vault(section(tmp_path), lambda *e: None)
    await first.start()
    await first.put("a", request())
    await first.close()
    (tmp_path / "vault.key").unlink()
    other = base64.b64encode(secrets.token_bytes(32)).decode()
    second = Vault(section(tmp_path, key=other), lambda *e: None)
    await second.start()
    try:
        assert (await second.for_session("a", "s-1", ["API_KEY"])).bindings.names == ()
    finally:
        await second.close()


# --- audit


async def test_one_bounded_event_per_connection(
    vault: tuple[Vault, list[tuple[Any, ...]]],
) -> None:
    kept, events = vault
    outcomes = [("API_KEY", "substituted")] + [(f"MADE_UP_{i}", "unknown") for i in range(40)]
    kept.used("a", "s-1", "api.example.com", outcomes)
    kept.used("a", "s-1", "other.example", [("API_KEY", "sent unchanged: host not bound")])
    assert [(e[0], e[3]) for e in events] == [
        ("secret.used", "substituted"),
        ("secret.used", "unchanged"),
    ]
    details = events[0][4]
    assert len(details["secrets"]) == MAX_USES_AUDITED
    assert details["secrets"][0] == {"name": "API_KEY", "outcome": "substituted"}
    assert details["more"] == len(outcomes) - MAX_USES_AUDITED
    assert events[1][4] == {
        "host": "other.example",
        "secrets": [{"name": "API_KEY", "outcome": "sent unchanged: host not bound"}],
    }


# --- reprs


async def test_no_key_in_a_repr_nor_the_ca_key_kept(
    vault: tuple[Vault, list[tuple[Any, ...]]], tmp_path: Path
) -> None:
    kept, _ = vault
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    assert key not in repr(section(tmp_path, key=key))
    ca = load_ca(tmp_path)
    assert b"PRIVATE KEY" in ca.key_pem and "PRIVATE KEY" not in repr(ca)
    held = repr(vars(kept)) + repr([vars(v) for v in vars(kept).values() if hasattr(v, "__dict__")])
    assert "PRIVATE KEY" not in held and ca.key_pem.decode() not in held
    assert kept.trust is not None and kept.trust.ca_cert == ca.cert_pem


# --- files


def test_files_are_written_whole_private_until_placed_and_kept_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert write_new(path, b"one", 0o600, replace=False) is True
    assert write_new(path, b"two", 0o600, replace=False) is False  # the first one's kept
    assert path.read_bytes() == b"one"
    assert write_new(path, b"three", 0o644) is True
    assert path.read_bytes() == b"three" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temporary left


@pytest.mark.parametrize("content", ["", "c2hvcnQ=\n", "not base64 at all\n"])
def test_a_damaged_key_file_stops_the_start_and_says_what_to_do(
    tmp_path: Path, content: str
) -> None:
    (tmp_path / "vault.key").write_text(content)
    with pytest.raises(VaultKeyError, match="restore the file from a backup"):
        load_key(None, tmp_path, clustered=False)
    assert (tmp_path / "vault.key").read_text() == content  # not replaced by a new key


def _given_ca(tmp_path: Path, validity: datetime.timedelta) -> tuple[Path, Path]:
    made = generate_ca("test CA", validity=validity)
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    cert.write_bytes(made.cert_pem)
    key.write_bytes(made.key_pem)
    key.chmod(0o600)
    return cert, key


def test_an_expired_ca_stops_the_start(tmp_path: Path) -> None:
    cert, key = _given_ca(tmp_path, datetime.timedelta(minutes=-30))
    with pytest.raises(VaultSettingError, match="expired"):
        load_ca(tmp_path / "state", cert_file=cert, key_file=key)


def test_a_ca_near_its_end_or_a_readable_key_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = _given_ca(tmp_path, datetime.timedelta(days=10))
    with caplog.at_level(logging.WARNING):
        load_ca(tmp_path / "state", cert_file=cert, key_file=key)
    assert any("expires on" in r.getMessage() for r in caplog.records)
    assert not any("may read" in r.getMessage() for r in caplog.records)
    caplog.clear()
    cert, key = _given_ca(tmp_path, datetime.timedelta(days=365))
    os.chmod(key, 0o640)
    with caplog.at_level(logging.WARNING):
        load_ca(tmp_path / "state", cert_file=cert, key_file=key)
    assert [r.getMessage() for r in caplog.records if "may read" in r.getMessage()]
    assert not any("expires on" in r.getMessage() for r in caplog.records)
