"""E2B's signed file URLs (`upload_url()`, `download_url()`): a link anyone holding it may use
to read, or write, one path of one sandbox, without a header, until it expires.

The SDK signs with the sandbox's access token, which it got from the control plane (E2B's
scheme "v1": SHA-256 of `path:operation:user:token[:expiration]`, base64 without padding). The
URL names the path, the user and the expiration, never the sandbox: `E2B_SANDBOX_URL` points
every sandbox's traffic at this service, so the sandbox is the one whose token makes the
signature, looked for among the sandboxes this replica knows (or only the one the request
names, in `E2b-Sandbox-Id` or a `<port>-<sandbox id>.<domain>` host). That walk costs a hash per
sandbox: a signature that opens none counts as a wrong key against its client's address, whose
guesses the service's key throttle slows down.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Literal

from starlette.requests import HTTPConnection

Operation = Literal["read", "write"]
VERSION_PREFIX = "v1_"
# E2B's sandbox hosts: `<port>-<sandbox id>.<domain>`.
_SANDBOX_HOST = re.compile(r"^[0-9]{1,5}-([A-Za-z0-9_-]{1,128})\.")
_MAX_SIGNATURE = 128  # a v1 signature is 46 characters; anything much longer is not one


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
    named_sandbox: str | None  # the sandbox its headers or host name, if any

    @classmethod
    def of(cls, request: HTTPConnection, method: str) -> SignedFileRequest | None:
        """The signed request, None when it carries no signature; SignedUrlRefused when it
        is malformed or expired."""
        query = request.query_params
        signature = query.get("signature")
        if signature is None:
            return None
        if not signature.startswith(VERSION_PREFIX) or len(signature) > _MAX_SIGNATURE:
            raise SignedUrlRefused(401, "the URL's signature is not one of E2B's (v1_...)")
        path = query.get("path", "")
        if not path:
            raise SignedUrlRefused(400, "a signed file URL names its file: ?path= is missing")
        user = query.get("username", "")
        if ":" in user:  # else `path:op:user` could be read two ways (a path may have colons)
            raise SignedUrlRefused(400, "a user name has no colon in it")
        expiration = None
        if (text := query.get("signature_expiration")) is not None:
            if not text.isdigit() or len(text) > 12:
                raise SignedUrlRefused(400, "signature_expiration is not a Unix time")
            expiration = int(text)
            if expiration < time.time():
                raise SignedUrlRefused(
                    401, "this signed URL has expired: ask the sandbox's owner for a new one"
                )
        return cls(
            signature=signature,
            path=path,
            operation="read" if method in ("GET", "HEAD") else "write",
            user=user,
            expiration=expiration,
            named_sandbox=request.headers.get("e2b-sandbox-id") or _host_sandbox(request),
        )

    def signed_with(self, token: str) -> bool:
        expected = signature_of(self.path, self.operation, self.user, token, self.expiration)
        return hmac.compare_digest(expected.encode(), self.signature.encode())


def _host_sandbox(request: HTTPConnection) -> str | None:
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
