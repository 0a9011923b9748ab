"""A sandbox's environment can hold nothing that would change how its launcher reads it: the
local backend hands bwrap its options NUL-separated, so a NUL in a value would start a new
option (`--bind / /host`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from code_interpreter_wire.spec import SandboxSpec, check_environment

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "env",
    [
        {"A": "x\0--bind\0/\0/host"},
        {"A\0--bind": "x"},
        {"A=B": "x"},
        {"": "x"},
    ],
)
def test_an_environment_no_launcher_could_hold_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        SandboxSpec(env=env)
    with pytest.raises(ValueError):
        check_environment(env)


def test_ordinary_environments_pass() -> None:
    env = {"PATH": "/x:/y", "lower_case": "", "UNICODE": "é ✓", "EQ": "a=b"}
    assert SandboxSpec(env=env).env == env
