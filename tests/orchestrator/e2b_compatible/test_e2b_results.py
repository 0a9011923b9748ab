"""E2B's result fields through its unmodified SDK, sync and async, on each backend: `chart`,
`data`, Pillow displays, and string values without their quotes."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import BoxAndWhiskerChart, ChartType, LineChart

from tests.orchestrator.service.conftest import Server

LINE = (
    "import matplotlib.pyplot as plt\n"
    "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
    "plt.title('Growth'); plt.xlabel('n'); plt.ylabel('n squared')\n"
    "plt.show()"
)
FRAME = "import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})"
PILLOW = "from PIL import Image\nimage = Image.new('RGB', (16, 8), (200, 30, 30))\n"


@pytest.fixture
async def asbx(e2b_env: Server, template: str) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(template=template)
    yield sandbox
    await sandbox.kill()


def check_line_chart(results: list[object]) -> None:
    (figure,) = results
    assert base64.b64decode(figure.png).startswith(b"\x89PNG")  # type: ignore[attr-defined]
    chart = figure.chart  # type: ignore[attr-defined]
    assert isinstance(chart, LineChart) and chart.type is ChartType.LINE
    assert (chart.title, chart.x_label, chart.y_label) == ("Growth", "n", "n squared")
    assert (chart.x_scale, chart.y_scale) == ("linear", "linear")
    (element,) = chart.elements
    assert element.label == "squares"
    assert [tuple(p) for p in element.points] == [(1, 1), (2, 4), (3, 9)]
    assert "chart" in figure.formats() and "png" in figure.formats()  # type: ignore[attr-defined]


BOXES = """
import matplotlib.pyplot as plt
scores = {'Class A': [85, 90, 78, 92, 88], 'Class B': [95, 89, 76, 91, 84, 87],
          'Class C': [75, 82, 88, 79, 86]}
fig, ax = plt.subplots()
ax.set_title('Exam Scores'); ax.set_xlabel('Class'); ax.set_ylabel('Score')
ax.boxplot(scores.values(), labels=scores.keys(), patch_artist=True)
plt.show()
"""


def test_a_box_plot_comes_back_as_a_box_and_whisker_chart(sbx: Sandbox) -> None:
    """As E2B's template (matplotlib 3.10) has it: boxplot's `labels=` (gone from 3.11),
    which model-written code passes, works, and the boxes come back as E2B's chart."""
    done = sbx.run_code(BOXES)
    assert done.error is None, done.error
    (figure,) = done.results
    chart = figure.chart
    assert isinstance(chart, BoxAndWhiskerChart) and chart.type is ChartType.BOX_AND_WHISKER
    assert (chart.title, chart.x_label, chart.y_label) == ("Exam Scores", "Class", "Score")
    boxes = chart.elements
    assert [b.label for b in boxes] == ["Class A", "Class B", "Class C"]
    assert [b.median for b in boxes] == [88, 88, 82]
    assert [b.outliers for b in boxes] == [[], [76], []]
    assert [(b.min, b.max) for b in boxes] == [(78, 92), (84, 95), (75, 88)]


def test_a_figure_comes_back_as_a_chart(sbx: Sandbox) -> None:
    done = sbx.run_code(LINE)
    assert done.error is None
    check_line_chart(done.results)
    assert done.to_json()  # the SDK serialises its chart as it does E2B's


def test_a_dataframe_comes_back_as_column_data(sbx: Sandbox) -> None:
    done = sbx.run_code(FRAME)
    assert done.error is None
    (frame,) = done.results
    assert frame.data == {"a": [1, 2, 3], "b": ["x", "y", "z"]}
    assert "<table" in (frame.html or "") and frame.is_main_result
    assert frame.extra == {}


def test_pillow_show_and_save_come_back_as_png(sbx: Sandbox) -> None:
    shown = sbx.run_code(PILLOW + "image.show()\nprint('Image shown.')")
    assert shown.error is None and shown.logs.stdout == ["Image shown.\n"]
    assert base64.b64decode(shown.results[0].png or "").startswith(b"\x89PNG")
    saved = sbx.run_code(PILLOW + "image.save('test.png')\nprint('Image saved.')")
    assert saved.error is None
    assert base64.b64decode(saved.results[0].png or "").startswith(b"\x89PNG")
    assert sbx.files.read("test.png", format="bytes").startswith(b"\x89PNG")


def test_a_string_value_comes_without_its_quotes(sbx: Sandbox) -> None:
    assert sbx.run_code("'supertest'").text == "supertest"
    assert sbx.run_code('"it\'s"').text == "it's"
    assert sbx.run_code("['a', 'b']").text == "['a', 'b']"  # only a whole quoted text
    assert sbx.run_code("12").text == "12"


async def test_async_chart_data_pillow_and_quotes(asbx: AsyncSandbox) -> None:
    chart = await asbx.run_code(LINE)
    assert chart.error is None
    check_line_chart(chart.results)
    frame = await asbx.run_code(FRAME)
    assert frame.results[0].data == {"a": [1, 2, 3], "b": ["x", "y", "z"]}
    shown = await asbx.run_code(PILLOW + "image.show()")
    assert base64.b64decode(shown.results[0].png or "").startswith(b"\x89PNG")
    saved = await asbx.run_code(PILLOW + "image.save('test.png')")
    assert base64.b64decode(saved.results[0].png or "").startswith(b"\x89PNG")
    assert (await asbx.run_code("import os; os.environ['HOME'] = 'x'; 'supertest'")).text == (
        "supertest"
    )


PLOTLY = "import plotly.express as px\npx.bar(x=['a', 'b'], y=[1, 3], title='Plotly').show()"


def check_plotly(results: list[object]) -> None:
    (shown,) = results
    figure = shown.extra["application/vnd.plotly.v1+json"]  # type: ignore[attr-defined]
    assert figure["layout"]["title"]["text"] == "Plotly"
    assert "plotly" in (shown.html or "").lower()  # type: ignore[attr-defined]
    assert base64.b64decode(shown.png or "").startswith(b"\x89PNG")  # type: ignore[attr-defined]


def test_plotly_show_gives_e2b_forms_and_a_png(sbx: Sandbox, template: str) -> None:
    if template != "docker":
        pytest.skip("plotly and kaleido's browser are in the Docker image only")
    done = sbx.run_code(PLOTLY)
    assert done.error is None, done.error
    check_plotly(done.results)


async def test_async_plotly_show_gives_e2b_forms_and_a_png(
    asbx: AsyncSandbox, template: str
) -> None:
    if template != "docker":
        pytest.skip("plotly and kaleido's browser are in the Docker image only")
    done = await asbx.run_code(PLOTLY)
    assert done.error is None, done.error
    check_plotly(done.results)
