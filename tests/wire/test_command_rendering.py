"""A `run_command` result as a model reads it: how it ended, its output trimmed, what was left
out counted and where to find it."""

from __future__ import annotations

import pytest

from code_interpreter_wire.processes import CommandResult
from code_interpreter_wire.tool_output import render_command

pytestmark = pytest.mark.unit


def result(**fields: object) -> CommandResult:
    base: dict[str, object] = {
        "pid": 7,
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "duration_s": 0.25,
    }
    return CommandResult.model_validate({**base, **fields})


def test_an_exit_code_and_both_streams_are_told() -> None:
    out = render_command(
        result(exit_code=2, stdout="a\nb\n", stderr="bad flag\n"), session_id="s-1", max_chars=2000
    )
    assert out.text == (
        "[stdout]\na\nb\n[stderr]\nbad flag\n[status] exit code 2 · 0.25 s · session_id s-1"
    )
    assert out.is_error and out.images == []


def test_success_without_output_says_so() -> None:
    out = render_command(result(), session_id="s-1", max_chars=2000)
    assert out.text.startswith("(no output)\n[status] exit code 0")
    assert not out.is_error


def test_a_timeout_says_why_and_is_an_error() -> None:
    ended = result(
        exit_code=None, signal=15, timed_out=True, error="killed after its time limit of 5 s"
    )
    out = render_command(ended, session_id="s-1", max_chars=2000)
    assert "[error] killed after its time limit of 5 s" in out.text
    assert "[status] timed out, killed with everything it started" in out.text
    assert out.is_error


def test_a_signal_is_named() -> None:
    out = render_command(result(exit_code=None, signal=9), session_id="s-1", max_chars=2000)
    assert "[status] killed by signal 9" in out.text and out.is_error


def test_long_output_is_trimmed_and_what_the_cap_dropped_is_counted() -> None:
    long = "".join(f"line {i}\n" for i in range(10_000))
    out = render_command(
        result(stdout=long, stdout_dropped=500, stderr_dropped=20), session_id="s-1", max_chars=2000
    )
    assert len(out.text) < 2600
    assert out.text.startswith("[stdout]\nline 0\n") and "line 9999" in out.text
    left_out = int(out.text.split("[note] ", 1)[1].split()[0])
    assert left_out == len(long.rstrip("\n")) - 2000 // 3 + 520
    assert "COMMAND > out.txt 2>&1" in out.text
