"""The structured forms E2B's kernel adds to rich results, on every backend: a figure's chart
data (`e2b/chart`), a DataFrame's columns (`e2b/data`), Pillow images shown or saved, plotly."""

from __future__ import annotations

import base64
import subprocess

import pytest

from code_interpreter_wire.results import Result
from sandbox import Backend, Sandbox
from tests.conftest import small_spec

PNG_MAGIC = b"\x89PNG"

LINE = (
    "import matplotlib.pyplot as plt\n"
    "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
    "plt.title('Growth'); plt.xlabel('n'); plt.ylabel('n squared')\n"
    "plt.show()"
)
CHARTS = {
    "line": LINE,
    "scatter": "import matplotlib.pyplot as plt\nplt.scatter([1, 2, 3], [3, 1, 2])\nplt.show()",
    "bar": "import matplotlib.pyplot as plt\nplt.bar(['a', 'b', 'c'], [3, 1, 2])\nplt.show()",
    "pie": (
        "import matplotlib.pyplot as plt\nplt.pie([1, 2, 3], labels=['a', 'b', 'c'])\nplt.show()"
    ),
    "box_and_whisker": (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\nax.boxplot([[85, 90, 78, 92], [95, 89, 76, 91, 84]], "
        "tick_labels=['A', 'B'], patch_artist=True)\nplt.show()"
    ),
    "superchart": (
        "import matplotlib.pyplot as plt\nfig, (a, b) = plt.subplots(1, 2)\n"
        "a.plot([1, 2]); b.bar(['x'], [1]); fig.suptitle('Both'); plt.show()"
    ),
}


def only_figure(results: list[Result]) -> Result:
    figures = [r for r in results if r.png is not None]
    assert len(figures) == 1, results
    return figures[0]


async def test_a_line_figure_comes_back_as_chart_data_beside_its_png(sandbox: Sandbox) -> None:
    done = await sandbox.execute(LINE)
    assert done.ok, done.error
    figure = only_figure(done.results)
    assert base64.b64decode(figure.png or "").startswith(PNG_MAGIC)
    chart = figure.chart
    assert chart is not None, figure
    assert chart["type"] == "line" and chart["title"] == "Growth"
    assert (chart["x_label"], chart["y_label"]) == ("n", "n squared")
    assert chart["x_scale"] == "linear" and chart["y_scale"] == "linear"
    (element,) = chart["elements"]
    assert element["label"] == "squares"
    assert [tuple(p) for p in element["points"]] == [(1, 1), (2, 4), (3, 9)]
    assert "e2b/chart" not in figure.extra


@pytest.mark.parametrize("kind", list(CHARTS))
async def test_every_chart_kind_is_recognised(sandbox: Sandbox, kind: str) -> None:
    done = await sandbox.execute(CHARTS[kind])
    assert done.ok, done.error
    chart = only_figure(done.results).chart
    assert chart is not None and chart["type"] == kind, chart
    assert chart["elements"]


async def test_a_blank_figure_has_no_chart(sandbox: Sandbox) -> None:
    done = await sandbox.execute("import matplotlib.pyplot as plt\nplt.figure()\nplt.show()")
    assert done.ok, done.error
    assert all(r.chart is None for r in done.results)


async def test_a_failing_chart_extraction_never_breaks_the_display(sandbox: Sandbox) -> None:
    code = (
        "import e2b_charts\n"
        "def broken(figure): raise RuntimeError('extraction failed')\n"
        "e2b_charts.chart_figure_to_dict = broken\n" + LINE
    )
    done = await sandbox.execute(code)
    assert done.ok, done.error
    figure = only_figure(done.results)
    assert figure.chart is None and "extraction failed" not in done.stderr


async def test_a_chart_over_the_result_limit_goes_alone_and_the_png_stays(
    backend: Backend,
) -> None:
    """A chart (here ~2 MB) that would put its figure over the execution's result limit is
    dropped; the figure itself is kept, where before the whole result was left out."""
    sandbox = await backend.create(small_spec(result_limit_bytes=1 << 20))
    try:
        done = await sandbox.execute(
            "import matplotlib.pyplot as plt\nplt.plot(range(100_000))\nplt.show()"
        )
    finally:
        await sandbox.close()
    assert done.ok, done.error
    figure = only_figure(done.results)
    assert base64.b64decode(figure.png or "").startswith(PNG_MAGIC)
    assert figure.chart is None and figure.text is not None and done.results_dropped == 0


async def test_a_chart_over_the_kernel_cap_is_never_sent(sandbox: Sandbox) -> None:
    done = await sandbox.execute(
        "import matplotlib.pyplot as plt\nplt.plot(range(300_000))\nplt.show()"
    )
    assert done.ok, done.error
    figure = only_figure(done.results)
    assert figure.chart is None and figure.png is not None


async def test_a_dataframe_value_comes_back_as_column_data(sandbox: Sandbox) -> None:
    done = await sandbox.execute(
        "import pandas as pd\n"
        "pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', None], "
        "'when': pd.to_datetime(['2024-01-01', '2024-01-02', '2024-01-03'])})"
    )
    assert done.ok, done.error
    main = done.main_result
    assert main is not None and main.html is not None and "<table" in main.html
    assert main.data == {
        "a": [1, 2, 3],
        "b": ["x", "y", None],
        "when": ["2024-01-01T00:00:00", "2024-01-02T00:00:00", "2024-01-03T00:00:00"],
    }
    others = await sandbox.execute("import pandas as pd\npd.Series([1, 2]), 7")
    assert others.main_result is not None and others.main_result.data is None


async def test_a_dataframe_with_missing_numbers_still_comes_back(sandbox: Sandbox) -> None:
    done = await sandbox.execute("import pandas as pd\npd.DataFrame({'v': [1.5, float('nan')]})")
    assert done.ok, done.error
    main = done.main_result
    assert main is not None and main.data is not None and main.data["v"][0] == 1.5
    assert main.text is not None and "NaN" in main.text
    assert done.model_dump_json()  # the whole execution still serialises


PILLOW_IMAGE = "from PIL import Image\nimage = Image.new('RGB', (16, 8), (200, 30, 30))\n"


async def test_pillow_show_displays_the_image_once(sandbox: Sandbox) -> None:
    done = await sandbox.execute(PILLOW_IMAGE + "image.show()\nprint('shown')")
    assert done.ok, done.error
    assert done.stdout == "shown\n"
    figure = only_figure(done.results)
    assert base64.b64decode(figure.png or "").startswith(PNG_MAGIC)


async def test_pillow_save_displays_the_image_and_writes_the_file(sandbox: Sandbox) -> None:
    done = await sandbox.execute(
        PILLOW_IMAGE + "image.save('red.png')\n"
        "import os\nprint(os.path.getsize('red.png') > 0, Image.open('red.png').size)"
    )
    assert done.ok, done.error
    assert done.stdout == "True (16, 8)\n"
    assert base64.b64decode(only_figure(done.results).png or "").startswith(PNG_MAGIC)
    quiet = await sandbox.execute(
        PILLOW_IMAGE + "import io\nbuffer = io.BytesIO()\nimage.save(buffer, 'PNG')"
    )
    assert quiet.ok and quiet.results == []  # only a path is a save the user sees


async def test_nothing_is_left_in_the_users_namespace(sandbox: Sandbox) -> None:
    done = await sandbox.execute("sorted(k for k in globals() if not k.startswith('_'))")
    assert done.text == "['In', 'Out', 'exit', 'get_ipython', 'open', 'quit']"


def kernel_image_has_plotly() -> bool:
    probe = ["/opt/kernel/bin/python", "-c", "import plotly, kaleido"]
    command = ["docker", "run", "--rm", "code-interpreter-kernel:latest", *probe]
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


async def test_plotly_show_gives_its_mime_form_and_a_png(backend: Backend) -> None:
    if backend.name != "docker":
        pytest.skip("plotly and kaleido's browser are in the Docker image only")
    if not kernel_image_has_plotly():
        pytest.fail("the kernel image has no plotly: rebuild it (make image)")
    sandbox = await backend.create(small_spec())
    try:
        done = await sandbox.execute(
            "import plotly.express as px\n"
            "fig = px.bar(x=['a', 'b'], y=[1, 3], title='Plotly')\nfig.show()"
        )
    finally:
        await sandbox.close()
    assert done.ok, done.error
    (shown,) = done.results
    figure = shown.extra["application/vnd.plotly.v1+json"]
    assert figure["layout"]["title"]["text"] == "Plotly"
    assert shown.html is not None and "plotly" in shown.html.lower()
    assert base64.b64decode(shown.png or "").startswith(PNG_MAGIC)


async def test_plotly_without_kaleido_still_shows_without_a_png(backend: Backend) -> None:
    """On a host whose plotly cannot render images, showing a figure is no error."""
    if backend.name == "docker" and not kernel_image_has_plotly():
        pytest.fail("the kernel image has no plotly: rebuild it (make image)")
    sandbox = await backend.create(small_spec())
    try:
        probe = await sandbox.execute("import importlib.util as u; bool(u.find_spec('plotly'))")
        if probe.text != "True":
            pytest.skip("no plotly beside this backend's kernel")
        done = await sandbox.execute(
            "import sys\nsys.modules['kaleido'] = None  # as if kaleido were not installed\n"
            "import plotly.graph_objects as go\ngo.Figure(go.Scatter(y=[1, 2])).show()"
        )
    finally:
        await sandbox.close()
    assert done.ok, done.error
    (shown,) = done.results
    assert "application/vnd.plotly.v1+json" in shown.extra and shown.png is None
