"""The approval webhook never raises and never writes its URL's secrets to the log: an operator's
URL that cannot even be parsed, or a webhook that is down, only means no decision from it."""

from __future__ import annotations

import logging
import socket

import pytest

from orchestrator.governance.stores.approval_store import ApprovalRecord
from orchestrator.governance.webhook import ApprovalWebhook

pytestmark = pytest.mark.unit

RECORD = ApprovalRecord(
    id="ap-1",
    kind="tool_call",
    session_id="s-1",
    owner="p_1",
    principal="alice",
    subject="send_money",
    created_at=0.0,
    expires_at=1.0,
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("url", ["http://[::1/hook", "http://127.0.0.1:99999/hook"])
async def test_a_url_that_cannot_be_used_is_no_decision_not_an_error(url: str) -> None:
    hook = ApprovalWebhook(url, None, 2.0)
    try:
        assert await hook.notify(RECORD) is None
    finally:
        await hook.aclose()


async def test_a_failing_webhook_is_logged_without_its_urls_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://hook-user:pa55word@127.0.0.1:{closed_port()}/hooks/T0KEN-in-the-path?sig=abc"
    hook = ApprovalWebhook(url, None, 2.0)
    try:
        with caplog.at_level(logging.WARNING):
            assert await hook.notify(RECORD) is None
    finally:
        await hook.aclose()
    assert "approval webhook" in caplog.text and "127.0.0.1" in caplog.text
    for secret in ("pa55word", "hook-user", "T0KEN", "sig=abc"):
        assert secret not in caplog.text, caplog.text
