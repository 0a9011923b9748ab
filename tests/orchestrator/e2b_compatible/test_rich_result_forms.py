"""E2B's structured forms in our results: how a bundle's `e2b/chart` and `e2b/data` are lifted,
kept within the limits, sized, shown to a model, and put on E2B's wire."""

from __future__ import annotations

import base64
import json

import pytest

from code_interpreter_wire.results import Execution, Result
from code_interpreter_wire.tool_output import render
from orchestrator.e2b_compatible.execute import result_fields
from orchestrator.streaming import result_size
from sandbox.kernel.collector import OutputCollector

pytestmark = pytest.mark.unit

PNG = base64.b64encode(b"\x89PNG" + b"\0" * 2000).decode()
CHART = {"type": "line", "title": "t", "elements": [{"label": "a", "points": [[1, 2]]}]}


def test_chart_and_data_are_lifted_into_their_fields() -> None:
    bundle = {"image/png": PNG, "e2b/chart": CHART, "e2b/data": {"a": [1]}, "x/other": 1}
    result = Result.from_bundle(bundle, is_main_result=False)
    assert result.chart == CHART and result.data == {"a": [1]}
    assert result.extra == {"x/other": 1}
    assert Result.model_validate_json(result.model_dump_json()) == result


def test_forms_of_another_shape_stay_as_they_came_and_an_empty_chart_is_none() -> None:
    odd = Result.from_bundle({"e2b/chart": "text", "e2b/data": [1]}, is_main_result=True)
    assert odd.chart is None and odd.data is None
    assert odd.extra == {"e2b/chart": "text", "e2b/data": [1]}
    blank = Result.from_bundle({"text/plain": "<Figure>", "e2b/chart": {}}, is_main_result=False)
    assert blank.chart is None and blank.extra == {}


async def test_a_bundle_over_the_limit_keeps_its_figure_and_drops_its_chart() -> None:
    collector = OutputCollector(1000, None, result_limit_bytes=10_000)
    big_chart = {"type": "line", "elements": [{"points": [[i, i] for i in range(2000)]}]}
    await collector.handle_content(
        {"data": {"image/png": PNG, "text/plain": "<Figure>", "e2b/chart": big_chart}},
        "display_data",
    )
    (kept,) = collector.results
    assert kept.png == PNG and kept.chart is None and collector.results_too_big == 0
    await collector.handle_content({"data": {"text/plain": "x" * 20_000}}, "display_data")
    assert collector.results_too_big == 1  # a bundle without derived forms is still left out


def test_the_backlog_counts_chart_and_data() -> None:
    plain = Result(text="t")
    rich = Result(text="t", chart=CHART, data={"a": list(range(1000))})
    assert result_size(rich) - result_size(plain) > len(json.dumps(rich.data))


def test_a_huge_data_form_never_reaches_the_model() -> None:
    columns = {"a": list(range(200_000))}
    frame = Result(is_main_result=True, text="   a\n0  0\n...", html="<table/>", data=columns)
    out = render(
        Execution(results=[frame]),
        session_id="s1",
        max_chars=4000,
        full_output_url=None,
        artifact_urls={},
    )
    assert len(out.text) < 4500 and "199999" not in out.text


@pytest.mark.parametrize(
    ("text", "on_e2b"),
    [
        ("'supertest'", "supertest"),
        ('"it\'s"', "it's"),
        ("'", ""),  # E2B's rule, to the letter: starts and ends with the same quote
        ("['a', 'b']", "['a', 'b']"),
        ("'a\"", "'a\""),
        ("", ""),
        ("42", "42"),
    ],
)
def test_e2b_strips_a_strings_quotes_and_our_result_keeps_them(text: str, on_e2b: str) -> None:
    result = Result(is_main_result=True, text=text)
    assert result_fields(result)["text"] == on_e2b
    assert result.text == text


def test_e2b_lines_carry_chart_data_and_the_leftover_forms() -> None:
    result = Result(png=PNG, chart=CHART, data={"a": [1]}, extra={"x/other": 1})
    line = result_fields(result)
    assert (line["chart"], line["data"], line["extra"]) == (CHART, {"a": [1]}, {"x/other": 1})
    assert result_fields(Result(text="1"))["extra"] == {}
    assert "chart" not in result_fields(Result(text="1"))
