"""A context's `cwd` reaches every later execution's kernel code (sandbox/kernel/scopes.py), so
the E2B front refuses one that is no valid Unicode text when the context is made, as /v1 does for
a per-call `cwd` (`KernelText`): later, in a Bash context, it would break the execution's stream
with an encoding error instead of a clear answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from code_interpreter_wire.rest import ExecuteRequest
from orchestrator.e2b_compatible.contexts import CreateContext
from sandbox.kernel.scopes import scope

pytestmark = pytest.mark.unit

LONE_SURROGATE = "/home/user/\ud800"


def test_such_a_cwd_is_what_breaks_a_bash_execution() -> None:
    with pytest.raises(UnicodeEncodeError):  # raised mid-stream: not a SandboxError
        scope("bash", {}, LONE_SURROGATE)
    with pytest.raises(ValidationError):  # /v1 refuses it up front
        ExecuteRequest.model_validate({"code": "pwd", "cwd": LONE_SURROGATE})


def test_a_context_cwd_that_is_no_valid_text_is_refused_up_front() -> None:
    with pytest.raises(ValidationError, match="lone surrogate"):
        CreateContext.model_validate({"language": "bash", "cwd": LONE_SURROGATE})
