"""The console's logins: a signed, expiring token for its cookie, and the CSRF token bound to it.

The token names the principal and the digest of the key that logged in, so each request can
check again that the key still holds (a revoked or rotated-out key is logged out at once). The
digest is sealed (XORed with a pad made from the secret and the login's own nonce): a leaked
cookie gives nothing to guess a weak key against offline, only the secret opens it. The secret
is the `console_secret` setting, or kept under the state dir (0600): a restart keeps everyone
logged in.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

SECRET_FILE = "console-secret"
TOKEN_TTL_S = 12 * 3600.0
MAX_TOKEN_CHARS = 1024  # a cookie longer than any token made here is refused unread
_SECRET_BYTES = 32
_DIGEST_BYTES = 32  # SHA-256
_VERSION = "v2"  # v1 carried the digest in the clear: refused


@dataclass(frozen=True)
class Login:
    principal_id: str
    key_digest: str  # sha256 hex of the key that logged in
    expires_at: float
    nonce: str  # the login's own: its CSRF token derives from it


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LoginTokens:
    def __init__(self, secret: bytes, ttl_s: float = TOKEN_TTL_S) -> None:
        if len(secret) < _SECRET_BYTES:
            raise ValueError(f"the console's secret must be at least {_SECRET_BYTES} bytes")
        self._secret = secret
        self.ttl_s = ttl_s

    def _sign(self, purpose: str, data: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}\n{data}".encode(), hashlib.sha256)
        return _b64(mac.digest())

    def _pad(self, nonce: str) -> bytes:
        """A pad no two logins share (each has its own nonce), known only with the secret."""
        return hmac.new(self._secret, f"seal\n{nonce}".encode(), hashlib.sha256).digest()

    def _seal(self, digest: str, nonce: str) -> str:
        """A key's SHA-256 hex as the cookie carries it: XORed with the login's pad."""
        if not digest:  # a login made while auth was off has no key
            return ""
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raw = b""
        if len(raw) != _DIGEST_BYTES:
            raise ValueError("a key digest is a SHA-256, 64 hex characters")
        return _b64(bytes(a ^ b for a, b in zip(raw, self._pad(nonce), strict=True)))

    def _unseal(self, sealed: str, nonce: str) -> str:
        if not sealed:
            return ""
        raw = _unb64(sealed)
        if len(raw) != _DIGEST_BYTES:
            raise ValueError("not a sealed digest")
        return bytes(a ^ b for a, b in zip(raw, self._pad(nonce), strict=True)).hex()

    def issue(self, principal_id: str, digest: str, *, now: float | None = None) -> str:
        expires = (time.time() if now is None else now) + self.ttl_s
        nonce = secrets.token_hex(16)
        payload = {"p": principal_id, "k": self._seal(digest, nonce), "e": expires, "n": nonce}
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{_VERSION}.{body}.{self._sign('login', body)}"

    def read(self, token: str | None, *, now: float | None = None) -> Login | None:
        """The login a token holds, if this service signed it and it has not expired."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        version, _, rest = token.partition(".")
        body, _, signature = rest.partition(".")
        if version != _VERSION or not _same(signature, self._sign("login", body)):
            return None
        try:
            payload = json.loads(_unb64(body))
            nonce = str(payload["n"])
            login = Login(
                principal_id=str(payload["p"]),
                key_digest=self._unseal(str(payload["k"]), nonce),
                expires_at=float(payload["e"]),
                nonce=nonce,
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if login.expires_at <= (time.time() if now is None else now):
            return None
        return login

    def csrf(self, login: Login) -> str:
        """The token every form of this login carries: useless with any other login."""
        return self._sign("csrf", login.nonce)

    def csrf_ok(self, login: Login, given: str | None) -> bool:
        return bool(given) and _same(str(given), self.csrf(login))


def _same(given: str, expected: str) -> bool:
    """Constant-time, for any text a client sends (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(given.encode(), expected.encode())
