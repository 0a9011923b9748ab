"""An execution as a model reads it: what is said, what is trimmed (and that it says so), which
images are listed and which attached."""

from __future__ import annotations

import base64

import pytest

from code_interpreter_wire.results import Execution, ExecutionError, ExecutionStatus, Result
from code_interpreter_wire.tool_output import (
    MAX_INLINE_IMAGE_BYTES,
    MAX_INLINE_IMAGES,
    RenderedOutput,
    render,
)

pytestmark = pytest.mark.unit

FULL = "http://127.0.0.1:8000/v1/sessions/s1/executions/e1"


def shown(
    execution: Execution,
    *,
    max_chars: int = 4000,
    full_output_url: str | None = FULL,
    artifact_urls: dict[str, str] | None = None,
) -> RenderedOutput:
    return render(
        execution,
        session_id="s1",
        max_chars=max_chars,
        full_output_url=full_output_url,
        artifact_urls=artifact_urls or {},
    )


def png(payload: bytes) -> Result:
    return Result(png=base64.b64encode(payload).decode(), text="<Figure size 640x480>")


def test_nothing_printed_says_no_output() -> None:
    out = shown(Execution(duration_s=0.125))
    assert out.text == "(no output)\n[status] ok · 0.12 s · session_id s1"
    assert out.images == []
    assert out.is_error is False


def test_sections_come_in_order_with_their_labels() -> None:
    execution = Execution(
        stdout="hello\n",
        stderr="careful\n",
        results=[Result(text="shown"), Result(is_main_result=True, text="42")],
        execution_count=7,
    )
    assert shown(execution).text == (
        "[stdout]\nhello\n[stderr]\ncareful\n[display]\nshown\n[result]\n42\n"
        "[status] ok · In[7] · 0.00 s · session_id s1"
    )


def test_an_image_result_gives_no_text_section() -> None:
    out = shown(Execution(results=[png(b"\x89PNG-bytes")]))
    assert "<Figure" not in out.text
    assert "[images] 1: image/png" in out.text


def test_a_long_stream_keeps_its_head_and_tail_and_says_how_much_was_cut() -> None:
    stdout = "H" * 3000 + "M" * 4000 + "T" * 3000
    out = shown(Execution(stdout=stdout), max_chars=1200)
    body = out.text.split("[stdout]\n", 1)[1].split("\n[note]", 1)[0]
    head, tail = body.split("\n[...]\n")
    # The share of each section: the budget over the sections (stdout, stderr) plus one.
    assert head == "H" * 266
    assert tail == "T" * 134
    cut = len(stdout) - 400
    assert f"[note] {cut} characters of output were left out here. The full output: GET {FULL}" in (
        out.text
    )


def test_characters_the_collector_dropped_are_counted_in_the_note() -> None:
    out = shown(Execution(stdout="short", stdout_dropped=1000, stderr_dropped=234))
    assert "[note] 1234 characters of output were left out here." in out.text
    assert "[stdout]\nshort" in out.text


def test_the_note_names_no_link_when_the_output_was_not_kept() -> None:
    out = shown(Execution(stdout_dropped=5), full_output_url=None)
    assert "[note] 5 characters of output were left out here.\n" in out.text
    assert "GET" not in out.text


def test_a_short_output_has_no_note() -> None:
    assert "[note]" not in shown(Execution(stdout="x" * 100)).text


def test_each_section_gets_at_least_two_hundred_characters() -> None:
    out = shown(Execution(stdout="a" * 200, stderr="b" * 200), max_chars=100)
    assert "a" * 200 in out.text
    assert "b" * 200 in out.text


def test_many_sections_still_fit_the_whole_budget_and_keep_the_status() -> None:
    results = [Result(text=f"display {i} " + "z" * 1000) for i in range(100)]
    out = shown(Execution(results=results, status=ExecutionStatus.OK), max_chars=1000)
    assert len(out.text) <= 1000 + 500 + len("\n[...]\n")
    assert out.text.endswith("session_id s1")


def traceback(lines: int) -> str:
    return "\n".join(f"  frame {i}" for i in range(lines)) + "\n"


def test_an_error_shows_its_name_value_and_traceback() -> None:
    error = ExecutionError(name="ZeroDivisionError", value="division by zero", traceback="tb 1\n")
    out = shown(Execution(status=ExecutionStatus.ERROR, error=error))
    assert "[error] ZeroDivisionError: division by zero\ntb 1\n[status] error" in out.text
    assert out.is_error is True
    assert "(no output)" not in out.text


def test_an_error_without_traceback_is_one_line() -> None:
    error = ExecutionError(name="Timeout", value="ran past 30 s")
    out = shown(Execution(status=ExecutionStatus.TIMEOUT, error=error))
    assert "[error] Timeout: ran past 30 s\n[status] timeout" in out.text


def test_a_traceback_of_thirty_lines_is_whole() -> None:
    error = ExecutionError(name="E", value="v", traceback=traceback(30))
    out = shown(Execution(status=ExecutionStatus.ERROR, error=error))
    assert "trimmed" not in out.text
    assert "frame 0\n" in out.text


def test_a_long_traceback_keeps_its_last_thirty_lines_and_says_so() -> None:
    error = ExecutionError(name="E", value="v", traceback=traceback(100))
    text = shown(Execution(status=ExecutionStatus.ERROR, error=error)).text
    kept = text.split("(traceback trimmed to its last lines)\n", 1)[1].split("\n[status]")[0]
    assert kept.splitlines() == [f"  frame {i}" for i in range(70, 100)]


@pytest.mark.parametrize(
    "status",
    [
        ExecutionStatus.ERROR,
        ExecutionStatus.TIMEOUT,
        ExecutionStatus.KERNEL_DIED,
        ExecutionStatus.CANCELLED,
    ],
)
def test_every_status_but_ok_is_an_error(status: ExecutionStatus) -> None:
    out = shown(Execution(status=status))
    assert out.is_error is True
    assert f"[status] {status} ·" in out.text


def test_a_lost_state_and_a_notice_are_told() -> None:
    execution = Execution(state_lost=True, notice="the kernel died while idle; it was restarted")
    text = shown(execution).text
    assert "[notice] the kernel died while idle; it was restarted\n" in text
    assert text.endswith("session_id s1 · kernel restarted, earlier variables are gone")


def test_images_are_listed_with_their_links() -> None:
    execution = Execution(results=[png(b"one"), Result(svg="<svg/>")])
    ids = [a.id for a in execution.artifacts]
    urls = {ids[0]: "http://127.0.0.1/a/1"}
    out = shown(execution, artifact_urls=urls)
    assert "[images] 2: image/png at http://127.0.0.1/a/1, image/svg+xml\n" in out.text
    assert [(i.mime_type, i.data, i.url) for i in out.images] == [
        ("image/png", b"one", "http://127.0.0.1/a/1"),
        ("image/svg+xml", b"<svg/>", None),
    ]
    # SVG is not an image a model API takes inline.
    assert [i.mime_type for i in out.attached()] == ["image/png"]
    assert "[note] 1 of them are attached" in out.text


def test_all_images_attached_needs_no_note() -> None:
    out = shown(Execution(results=[png(b"a"), png(b"b")]))
    assert "[images] 2: image/png, image/png" in out.text
    assert "attached" not in out.text
    assert len(out.attached()) == 2


def test_an_image_over_the_inline_size_is_listed_not_attached() -> None:
    big = b"\x00" * (MAX_INLINE_IMAGE_BYTES + 1)
    out = shown(Execution(results=[png(big), png(b"small")]))
    assert [len(i.data) for i in out.attached()] == [5]
    assert "[note] 1 of them are attached: at most 20 PNG, JPEG, GIF or WebP images" in out.text


def test_at_most_so_many_images_are_attached() -> None:
    count = MAX_INLINE_IMAGES + 5
    out = shown(Execution(results=[png(bytes([i])) for i in range(count)]))
    assert len(out.images) == count
    assert [i.data for i in out.attached()] == [bytes([i]) for i in range(MAX_INLINE_IMAGES)]
    assert f"[note] {MAX_INLINE_IMAGES} of them are attached" in out.text
