"""How the tool renders other languages' executions for a model: Bash's nameless error, a
display with HTML only (Deno's), R's data frame as its plain text, the language named."""

from __future__ import annotations

import pytest

from code_interpreter_wire.results import Execution, ExecutionError, ExecutionStatus, Result
from code_interpreter_wire.tool_output import render

pytestmark = pytest.mark.unit


def rendered(execution: Execution, language: str | None = None) -> str:
    out = render(
        execution,
        language=language,
        session_id="s-1",
        max_chars=2000,
        full_output_url=None,
        artifact_urls={},
    )
    return out.text


def test_a_bash_error_says_its_exit_status_not_an_empty_name() -> None:
    failed = Execution(
        status=ExecutionStatus.ERROR,
        stdout="ls: cannot access 'x'\n",
        error=ExecutionError(name="", value="2", traceback=""),
    )
    text = rendered(failed, "bash")
    assert "[error] exit status 2" in text and "[error] :" not in text
    assert "[status] error · bash · " in text


def test_an_html_only_display_is_named_not_dropped() -> None:
    shown = Execution(results=[Result(html="<b>hi</b>")])
    text = rendered(shown, "javascript")
    assert "[display]\n(HTML output with no plain-text form" in text
    assert "(no output)" not in text


def test_a_data_frame_reads_as_its_plain_text_and_python_is_not_named() -> None:
    frame = Execution(results=[Result(text="  n s\n1 1 a", html="<table></table>")])
    assert "[display]\n  n s\n1 1 a" in rendered(frame, "r")
    assert "<table" not in rendered(frame, "r")
    assert " · python · " not in rendered(frame, "python")
    markdown = Execution(results=[Result(markdown="**bold**", is_main_result=True)])
    assert "[result]\n**bold**" in rendered(markdown)
