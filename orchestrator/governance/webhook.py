"""The operator's webhook: told of each approval request, and able to decide it in its answer.

POST <approval_webhook_url>, JSON:
    {"type": "approval.requested", "approval": {<the request: id, kind, session_id, principal,
     subject, arguments, code, created_at, expires_at, ...>}, "answer": "POST /v1/approvals/<id>"}
With a secret set, `X-CIR-Signature: sha256=<hex>` is the HMAC-SHA256 of the exact body with
it: the receiver checks it before trusting a request (and the answer below decides only what it
was asked). An answer `{"decision": "approve"|"deny", "reason": "..."}` decides the request at
once; any other answer (none, 202, not JSON) leaves it to a human, who answers through the API.

The call is bounded (`approval_webhook_timeout_s`, an answer of at most 64 KiB) and never
raises: a webhook that is down or slow only means no decision came from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator

from orchestrator.governance.stores.approval_store import ApprovalRecord

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-CIR-Signature"
MAX_ANSWER_BYTES = 64 << 10
MAX_REASON_CHARS = 1000


class WebhookAnswer(BaseModel):
    decision: Literal["approve", "deny"]
    reason: str | None = Field(None)

    @field_validator("reason")
    @classmethod
    def _capped(cls, value: str | None) -> str | None:
        return value[:MAX_REASON_CHARS] if value is not None else None

    @property
    def approve(self) -> bool:
        return self.decision == "approve"


def signature(secret: str, body: bytes) -> str:
    """The header's value: `sha256=` and the HMAC-SHA256 hex of `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def request_body(record: ApprovalRecord) -> bytes:
    payload: dict[str, Any] = {
        "type": "approval.requested",
        "approval": record.model_dump(mode="json"),
        "answer": f"POST /v1/approvals/{record.id}",
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def shown_url(url: str) -> str:
    """What the log may say of the webhook's URL: its scheme, host and port. Its path, query
    and user info often hold a secret (a chat service's webhook token)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # not even a URL: nothing of it is shown
        return "(an unreadable URL)"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}"


class ApprovalWebhook:
    def __init__(self, url: str, secret: SecretStr | None, timeout_s: float) -> None:
        self.url = url
        self._shown = shown_url(url)
        self._secret = secret
        self._timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def notify(self, record: ApprovalRecord) -> WebhookAnswer | None:
        """Tell the webhook; its decision if it gave one (else None). Never raises."""
        body = request_body(record)
        headers = {"Content-Type": "application/json"}
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = signature(self._secret.get_secret_value(), body)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout_s)
        try:  # bounded as a whole: a webhook that answers a byte a second is cut off too
            async with asyncio.timeout(self._timeout_s):
                request = self._client.build_request(
                    "POST", self.url, content=body, headers=headers
                )
                response = await self._client.send(request, stream=True)
                try:
                    answer = bytearray()
                    async for chunk in response.aiter_bytes():
                        answer += chunk
                        if len(answer) > MAX_ANSWER_BYTES:
                            log.warning("approval webhook: an answer over %d bytes", len(answer))
                            return None
                finally:
                    await response.aclose()
        except (httpx.HTTPError, TimeoutError) as exc:
            log.warning("approval webhook %s failed: %s", self._shown, self._said(exc))
            return None
        except Exception as exc:  # a URL httpx cannot use (a bad port, a broken host): no decision
            log.warning("approval webhook %s cannot be called: %s", self._shown, self._said(exc))
            return None
        if response.is_error or not answer.strip():
            if response.is_error:
                log.warning("approval webhook answered HTTP %d", response.status_code)
            return None
        try:
            return WebhookAnswer.model_validate_json(bytes(answer))
        except ValidationError:
            return None  # an acknowledgement, not a decision: a human answers

    def _said(self, exc: BaseException) -> str:
        """An error as the log may show it: never with the URL's secret parts."""
        text = f"{type(exc).__name__}: {exc}"[:300]
        try:
            parts = urlsplit(self.url)
            hidden = [self.url, parts.path, parts.query, parts.username, parts.password]
        except ValueError:
            return type(exc).__name__  # a URL too broken to tell its parts: the kind alone
        for secret in hidden:
            if secret and len(secret) > 1:
                text = text.replace(secret, "...")
        return text

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
