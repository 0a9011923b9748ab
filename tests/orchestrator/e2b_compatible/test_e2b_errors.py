"""Errors on the E2B-compatible front, in the shape E2B's SDK parses: `{"code", "message"}`, the
status its SDK turns into the matching exception, and `Should-Retry` only where waiting helps."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from code_interpreter_wire.errors import (
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    SandboxClosed,
    SandboxError,
)
from orchestrator.e2b_compatible.errors import E2BError, error_response
from orchestrator.e2b_compatible.sandboxes import SandboxGone
from orchestrator.outputs import OutputNotFound
from orchestrator.request_context import ClientGone
from orchestrator.sessions import (
    BackendNotEnabled,
    SessionExpired,
    SessionLimitReached,
    SessionNotFound,
)

pytestmark = pytest.mark.unit


def answer(exc: Exception) -> tuple[int, dict[str, object], str]:
    response = error_response(exc)
    body = json.loads(bytes(response.body))
    assert response.headers["content-type"] == "application/json"
    return response.status_code, body, response.headers["should-retry"]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (E2BError(409, "the sandbox is paused"), 409),
        (SessionNotFound("no session s1"), 404),
        (OutputNotFound("no execution e1 in session s1"), 404),
        (SessionExpired("session s1 expired"), 404),  # E2B has no 410: a killed sandbox is gone
        (SessionLimitReached("too many sessions"), 429),
        (BackendNotEnabled("docker is not enabled"), 400),
        (HTTPException(413, "the body is too large"), 413),
        (InvalidPath("'..' climbs out"), 400),
        (FileAccessError("a symlink"), 400),  # E2B's SDK: a refused path is a bad request
        (FileMissing("no such file"), 404),
        (FileTooLarge("too big"), 413),
        (SandboxClosed("closed"), 502),  # what E2B's proxy says of a sandbox that is gone
        (BackendTimeout("no answer"), 504),
        (BackendUnavailable("no engine"), 503),
        (SandboxError("other"), 500),
    ],
)
def test_each_error_gets_the_status_e2b_s_sdk_expects(error: Exception, status: int) -> None:
    got, body, retry = answer(error)
    assert got == status
    assert body == {
        "code": status,
        "message": str(error.detail if isinstance(error, HTTPException) else error),
    }
    assert retry == "false"


def test_a_gone_sandbox_says_was_not_found_as_e2b_s_proxy_does() -> None:
    status, body, retry = answer(SandboxGone("sbx-1"))
    assert (status, retry) == (502, "false")
    assert body["message"] == "The sandbox sbx-1 was not found"


def test_only_a_rate_limit_is_worth_retrying() -> None:
    status, _, retry = answer(BackendRateLimited("slow down"))
    assert (status, retry) == (429, "true")
    # Our own session quota is also a 429, but waiting does not free a session.
    assert answer(SessionLimitReached("full"))[2] == "false"


def test_invalid_input_is_told_in_one_line() -> None:
    exc = RequestValidationError(
        [{"loc": ("body", "timeout"), "msg": "Input should be a valid integer", "type": "x"}]
    )
    assert answer(exc)[:2] == (
        400,
        {"code": 400, "message": "body.timeout: Input should be a valid integer"},
    )


def test_a_client_that_left_gets_499() -> None:
    status, body, _ = answer(ClientGone())
    assert status == 499
    assert body["message"] == "the client disconnected; its code was stopped"


@pytest.mark.parametrize("error", [KeyError("secret-key-name"), RuntimeError("boom"), ValueError()])
def test_a_bug_is_a_logged_500_that_tells_nothing_of_it(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="orchestrator.e2b_compatible.errors"):
        status, body, retry = answer(error)
    assert (status, retry) == (500, "false")
    assert body == {"code": 500, "message": "the server failed; see its log"}
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [error]
