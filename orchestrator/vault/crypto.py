"""The deployment's vault key and the sealing of values under it.

AES-256-GCM with a fresh 12-byte nonce per value. The associated data binds each ciphertext to
its owner, its name and its binding (hosts, methods, path prefixes, headers: canonical JSON
after a version byte), so a sealed value copied to another key's row or name, or a row whose
binding was changed (in vault.db or Redis, by whoever can write there but has no key), does not
open. The key comes from the settings (`vault_key`, base64 of 32 bytes), or on one machine is
made once into the state dir (`vault.key`, mode 0600). A cluster's replicas must share it, so
there it must be set: a key made on one replica would not open what another sealed."""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from orchestrator.durable_files import write_new
from orchestrator.vault.records import SecretBinding, VaultSettingError, VaultUnavailable

KEY_FILE = "vault.key"
KEY_BYTES = 32
NONCE_BYTES = 12
_AD_PREFIX = b"cir-vault\x00"
_AD_VERSION = b"\x02"  # 2: owner, name and binding as canonical JSON (1 had owner and name)


class VaultKeyError(VaultSettingError):
    """The vault key given, or the one in the state dir, is not base64 of 32 bytes."""


def decode_key(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise VaultKeyError(f"{where} is not base64") from None
    if len(key) != KEY_BYTES:
        raise VaultKeyError(f"{where} must be base64 of {KEY_BYTES} bytes, not {len(key)}")
    return key


def load_key(given: str | None, state_dir: Path, *, clustered: bool) -> bytes:
    """The vault key: `given` (the setting), else the state dir's file (made at first use)."""
    if given is not None:
        return decode_key(given, "vault_key")
    if clustered:
        raise VaultUnavailable(
            "the credential vault needs vault_key (CODE_INTERPRETER_VAULT_KEY: base64 of 32 "
            "bytes, e.g. `openssl rand -base64 32`) in cluster mode: every replica must seal "
            "and open secrets with the same key"
        )
    path = state_dir / KEY_FILE
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        text = base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()
        # Whole and synced before it has its name (a crash leaves no empty or half key), and
        # never over another: two processes starting at once keep the first one's.
        write_new(path, (text + "\n").encode(), 0o600, replace=False)
    path.chmod(0o600)
    try:
        return decode_key(path.read_text(), str(path))
    except VaultKeyError as exc:
        raise VaultKeyError(
            f"{exc}: the vault key file is damaged (empty or cut short). A new key would leave "
            "every stored secret unreadable, so none is made: restore the file from a backup, "
            "or set vault_key to the key; if no secret was ever stored, delete the file and "
            "start again (a new key is made)"
        ) from None


def _associated(owner: str, name: str, binding: SecretBinding) -> bytes:
    canonical = json.dumps(
        {"owner": owner, "name": name, "binding": binding.model_dump(mode="json")},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return _AD_PREFIX + _AD_VERSION + canonical.encode()


class Sealer:
    """Seals and opens values of one deployment's vault."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def __repr__(self) -> str:
        return "Sealer(key=**********)"

    def seal(self, owner: str, name: str, binding: SecretBinding, value: str) -> tuple[str, str]:
        """(nonce, ciphertext), each base64."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, value.encode(), _associated(owner, name, binding))
        return base64.b64encode(nonce).decode(), base64.b64encode(sealed).decode()

    def open(
        self, owner: str, name: str, binding: SecretBinding, nonce: str, ciphertext: str
    ) -> str:
        """The value; VaultUnavailable when it does not open (another key, its binding changed
        at rest, or tampered)."""
        try:
            plain = self._aead.decrypt(
                base64.b64decode(nonce),
                base64.b64decode(ciphertext),
                _associated(owner, name, binding),
            )
        except (InvalidTag, binascii.Error, ValueError):
            raise VaultUnavailable(
                f"secret {name} does not open with this deployment's vault key (was vault_key "
                "changed, or its record changed at rest?): store it again"
            ) from None
        return plain.decode()
