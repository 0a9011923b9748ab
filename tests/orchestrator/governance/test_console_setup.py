"""How the service is set up for the console: the request gate knows its paths as a family of
their own (their pages check their login cookie), whether the E2B front is on or off; a shared
login secret (`console_secret`) too short to be one is refused at start, saying how to make
one."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from orchestrator.auth import Authenticator
from orchestrator.config import Settings
from orchestrator.request_guard import Family, RequestGuard


async def _app(scope: Scope, receive: Receive, send: Send) -> None:  # never reached here
    raise AssertionError("not called")


@pytest.mark.parametrize("e2b_front", [False, True])
def test_the_console_is_a_family_of_its_own(e2b_front: bool) -> None:
    settings = Settings(api_keys=["k"])
    sandboxes: Any = object() if e2b_front else None  # only whether the front is on is read
    guard = RequestGuard(
        _app,
        authenticate=Authenticator(settings),
        sandboxes=sandboxes,
        max_json_depth=64,
        metrics_public=False,
    )
    for path in ("/console", "/console/", "/console/login", "/console/static/htmx.min.js"):
        assert guard.family(path) is Family.CONSOLE, path
    assert guard.family("/consoles") is Family.OTHER
    assert guard.family("/v1/sessions") is Family.BEARER


def test_a_console_secret_too_short_is_refused_saying_how_to_make_one() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(api_keys=["k"], console_secret="x" * 31)
    message = str(refused.value)
    assert "console_secret must be at least 32 characters" in message
    assert "secrets.token_urlsafe(32)" in message and "x" * 31 not in message
    assert Settings(api_keys=["k"], console_secret="x" * 32).console_secret is not None
