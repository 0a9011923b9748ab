"""E2B's signed file URLs (`upload_url()`, `download_url()`): a link anyone holding it may use
to read, or write, one path of one sandbox, without a header, until it expires.

The SDK signs with the sandbox's access token, which it got from the control plane (E2B's
scheme "v1": SHA-256 of `path:operation:user:token[:expiration]`, base64 without padding). The
URL names the path, the user and the expiration, never the sandbox: `E2B_SANDBOX_URL` points
every sandbox's traffic at this service, so the sandbox is the one whose token makes the
signature, looked for among the sandboxes this replica knows (in cluster mode, then among every
replica's), or only the one `E2b-Sandbox-Id` names (a `<port>-<sandbox id>.<domain>` host's is
tried first). That walk costs a short hash per sandbox: a signature that opens none counts as a
wrong key against its client's address, whose guesses the service's key throttle slows down.
Whoever holds a link may wake a sandbox that resumes on traffic, as on E2B.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Literal

from starlette.requests import HTTPConnection

Operation = Literal["read", "write"]
VERSION_PREFIX = "v1_"
_SIGNATURE = re.compile(r"v1_[A-Za-z0-9+/]{43}")  # SHA-256, base64 without its padding
_UNIX_TIME = re.compile(r"[0-9]{1,12}")
MAX_SIGNED_PATH = 4096  # characters: each sandbox tried hashes none of it again (see signed_with)
# E2B's sandbox hosts: `<port>-<sandbox id>.<domain>`.
_SANDBOX_HOST = re.compile(r"^[0-9]{1,5}-([A-Za-z0-9_-]{1,128})\.")


class SignedUrlRefused(Exception):
    """A signed URL that opens nothing: 401 (or 400 when it is malformed), and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def signature_of(
    path: str, operation: Operation, user: str, token: str, expiration: int | None
) -> str:
    """What E2B's SDK signs a URL with (`e2b.sandbox.signature.get_signature`)."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return VERSION_PREFIX + base64.b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class SignedFileRequest:
    """A request to E2B's `/files` that carries a signature instead of a sandbox's token."""

    signature: str
    path: str
    operation: Operation
    user: str
    expiration: int | None
    named_sandbox: str | None  # the sandbox its `E2b-Sandbox-Id` names: only that one is tried
    host_sandbox: str | None  # the one its host may name (`<port>-<id>.<domain>`): tried first

    @classmethod
    def of(cls, request: HTTPConnection) -> SignedFileRequest | None:
        """The signed request, None when it carries no signature; SignedUrlRefused when it
        is malformed or expired. Checked before any hashing: a malformed one costs nothing."""
        query = request.query_params
        signature = query.get("signature")
        if signature is None:
            return None
        if not _SIGNATURE.fullmatch(signature):
            raise SignedUrlRefused(401, "the URL's signature is not one of E2B's (v1_...)")
        path = query.get("path", "")
        if not path:
            raise SignedUrlRefused(400, "a signed file URL names its file: ?path= is missing")
        if len(path) > MAX_SIGNED_PATH:
            raise SignedUrlRefused(400, f"a signed path is at most {MAX_SIGNED_PATH} characters")
        user = query.get("username", "")
        if ":" in user:  # else `path:op:user` could be read two ways (a path may have colons)
            raise SignedUrlRefused(400, "a user name has no colon in it")
        expiration = None
        if (text := query.get("signature_expiration")) is not None:
            if not _UNIX_TIME.fullmatch(text):
                raise SignedUrlRefused(400, "signature_expiration is not a Unix time")
            expiration = int(text)
            if expiration < time.time():
                raise SignedUrlRefused(
                    401, "this signed URL has expired: ask the sandbox's owner for a new one"
                )
        return cls(
            signature=signature,
            path=path,
            operation="read" if request.scope.get("method") in ("GET", "HEAD") else "write",
            user=user,
            expiration=expiration,
            named_sandbox=request.headers.get("e2b-sandbox-id") or None,
            host_sandbox=_host_sandbox(request),
        )

    @functools.cached_property
    def _signed_prefix(self) -> hashlib._Hash:
        """The hash of what precedes the token (the request's own part, up to 4 KiB), made
        once: each sandbox tried costs the hash of its token alone, however long the path."""
        return hashlib.sha256(f"{self.path}:{self.operation}:{self.user}:".encode())

    def signed_with(self, token: str) -> bool:
        """Whether `token` (a sandbox's access token) made this request's signature."""
        digest = self._signed_prefix.copy()
        digest.update(token.encode())
        if self.expiration is not None:
            digest.update(f":{self.expiration}".encode())
        expected = VERSION_PREFIX + base64.b64encode(digest.digest()).rstrip(b"=").decode()
        return hmac.compare_digest(expected.encode(), self.signature.encode())


def _host_sandbox(request: HTTPConnection) -> str | None:
    """The sandbox id an E2B-style host names, if the host is one (it may be another
    proxy's `<port>-<name>.` host: only a hint)."""
    found = _SANDBOX_HOST.match(request.headers.get("host", ""))
    return found.group(1) if found else None


@dataclass(frozen=True)
class SignedFile:
    """What a signed URL opened (the request gate's finding, in the request's state)."""

    sandbox_id: str
    token: str


def signed_file_of(request: HTTPConnection) -> SignedFile | None:
    """The sandbox a request's signed URL opened, if it came with one that did."""
    found = getattr(request.state, "signed_file", None)
    return found if isinstance(found, SignedFile) else None
