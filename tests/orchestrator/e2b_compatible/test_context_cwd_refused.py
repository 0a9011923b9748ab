"""A context made with a working directory that is no valid text is a clear error (a 400 when it
is made, or an execution error through E2B's own SDK): never a 500, a context listing that fails
from then on, or a stream broken off mid-answer."""

from __future__ import annotations

import httpx
import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import Server


def test_a_bash_context_whose_cwd_is_no_valid_text_fails_clearly(
    e2b_env: Server, template: str
) -> None:
    sandbox = Sandbox.create(template=template)
    try:
        headers = {
            "E2b-Sandbox-Id": sandbox.sandbox_id,
            "X-Access-Token": sandbox._envd_access_token or "",
        }
        # JSON may spell a lone surrogate; E2B's SDK passes on whatever cwd it is given.
        body = b'{"language": "bash", "cwd": "/home/user/\\ud800"}'
        with httpx.Client(base_url=e2b_env.url, headers=headers, timeout=120) as raw:
            made = raw.post("/contexts", content=body, headers={"Content-Type": "application/json"})
        assert made.status_code in (200, 400), made.text  # never a 500
        listed = sandbox.list_code_contexts()  # the sandbox's contexts still list
        if made.status_code == 400:
            assert made.json()["code"] == 400 and "cwd" in made.json()["message"], made.text
            assert all(c.cwd == "/home/user" for c in listed), listed  # none was left made
            return  # refused when made, saying why: the clear error
        context = next(c for c in listed if c.id == made.json()["id"])
        try:
            ran = sandbox.run_code("pwd", context=context)
        except httpx.HTTPError as exc:  # the stream broke off: what must not happen
            pytest.fail(f"the execution's stream broke off: {exc!r}")
        except SandboxException:
            return  # a clear refusal
        assert ran.error is not None, ran
    finally:
        sandbox.kill()
