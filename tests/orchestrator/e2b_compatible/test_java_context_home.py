"""A Java context made with E2B's own default working directory, `/home/user`, spelled out (as
a client passing `cwd` through does) runs code, as it does on E2B: a JVM cannot change its
directory, but this is the one it already runs in."""

from __future__ import annotations

import pytest
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import Server


def test_a_java_context_with_e2b_home_as_its_cwd_runs_code(e2b_env: Server, template: str) -> None:
    sandbox = Sandbox.create(template=template)
    try:
        if "java" not in [c.language for c in sandbox.list_code_contexts()]:
            pytest.skip("this backend's default sandbox has no Java (the default image)")
        context = sandbox.create_code_context(language="java", cwd="/home/user")
        ran = sandbox.run_code("1 + 1", context=context)
        assert ran.error is None, ran.error
        assert ran.text == "2"
    finally:
        sandbox.kill()
