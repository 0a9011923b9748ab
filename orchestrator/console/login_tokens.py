"""The console's logins: a sealed, expiring token for its cookie, and the CSRF token it holds.

The token names the principal and the digest of the key that logged in, so each request can
check again that the key still holds (a revoked or rotated-out key is logged out at once). It is
a Fernet token (`cryptography`: AES-CBC and HMAC-SHA256, with its own time stamp checked against
the login's lifetime), so a leaked cookie shows nothing of the key's digest to guess a weak key
against offline, and only the secret makes or opens one. The Fernet key is derived from the
secret (HKDF-SHA256). The secret is the `console_secret` setting, or kept under the state dir
(0600): a restart keeps everyone logged in.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_FILE = "console-secret"
TOKEN_TTL_S = 12 * 3600.0
MAX_TOKEN_CHARS = 1024  # a cookie longer than any token made here is refused unread
_SECRET_BYTES = 32
_DIGEST_CHARS = 64  # SHA-256, hex
_VERSION = "v3"  # v1 carried the digest in the clear, v2 sealed it by hand: both refused


@dataclass(frozen=True)
class Login:
    principal_id: str
    key_digest: str  # sha256 hex of the key that logged in
    expires_at: float
    nonce: str  # the login's own, random: its CSRF token, and what a logout remembers


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_secret(state_dir: Path) -> bytes:
    """The secret under `state_dir`, made (0600) the first time. Two processes starting at
    once agree: the file appears whole or not at all (written aside, then linked)."""
    path = state_dir / SECRET_FILE
    with contextlib.suppress(FileNotFoundError):
        secret = path.read_bytes()
        if len(secret) >= _SECRET_BYTES:
            return secret
    state_dir.mkdir(parents=True, exist_ok=True)
    aside = state_dir / f".{SECRET_FILE}.{secrets.token_hex(8)}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES))
        try:
            os.link(aside, path)
        except FileExistsError:  # another process made it first (or a short one is there)
            if len(path.read_bytes()) < _SECRET_BYTES:
                os.replace(aside, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
    return path.read_bytes()


class LoginTokens:
    def __init__(self, secret: bytes, ttl_s: float = TOKEN_TTL_S) -> None:
        if len(secret) < _SECRET_BYTES:
            raise ValueError(f"the console's secret must be at least {_SECRET_BYTES} bytes")
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"cir console login"
        ).derive(secret)
        self._fernet = Fernet(base64.urlsafe_b64encode(derived))
        self.ttl_s = ttl_s

    def issue(self, principal_id: str, digest: str, *, now: float | None = None) -> str:
        """A login of `principal_id` by the key of SHA-256 `digest` ("" while auth is off)."""
        if digest and (len(digest) != _DIGEST_CHARS or not _is_hex(digest)):
            raise ValueError("a key digest is a SHA-256, 64 hex characters")
        issued = time.time() if now is None else now
        payload = {"p": principal_id, "k": digest, "n": secrets.token_urlsafe(24)}
        data = json.dumps(payload, separators=(",", ":")).encode()
        return f"{_VERSION}.{self._fernet.encrypt_at_time(data, int(issued)).decode()}"

    def read(self, token: str | None, *, now: float | None = None) -> Login | None:
        """The login a token holds, if this service made it and it has not expired."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        version, _, sealed = token.partition(".")
        if version != _VERSION:
            return None
        at = time.time() if now is None else now
        try:
            # Fernet's own check of age is in whole seconds: the exact expiry is checked below.
            data = self._fernet.decrypt_at_time(sealed.encode(), int(self.ttl_s) + 1, int(at))
            issued = self._fernet.extract_timestamp(sealed.encode())
            payload = json.loads(data)
            login = Login(
                principal_id=str(payload["p"]),
                key_digest=str(payload["k"]),
                expires_at=issued + self.ttl_s,
                nonce=str(payload["n"]),
            )
        except (InvalidToken, ValueError, KeyError, TypeError):
            return None
        if login.expires_at <= at:
            return None
        return login

    def csrf(self, login: Login) -> str:
        """The token every form of this login carries: useless with any other login, and seen
        only by whoever holds the login (it travels sealed in the cookie)."""
        return login.nonce

    def csrf_ok(self, login: Login, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(str(given).encode(), login.nonce.encode())


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
