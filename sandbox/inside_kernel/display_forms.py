"""Runs inside every Python kernel before the start-up file (ipykernel's `exec_files`, from the
same directory), on every backend: the display forms E2B's kernel adds, and patches applied to
libraries when code first imports them (Pillow, plotly, matplotlib's fonts and boxplot).

Standard library only, beside what the kernel itself runs on (IPython); the data libraries it
adapts (pandas, matplotlib, e2b-charts, Pillow, plotly) are used only if the code imports them.
Run first, so that the modules the start-up file preloads get their patches as well. The Docker
images copy this file as it is. It must leave nothing behind in the user's namespace.
"""


def _install_e2b_display_forms() -> None:
    """The display forms E2B's kernel adds, so its SDK's `Result` fields fill as they do there.

    Read from e2b-dev/code-interpreter, template/startup_scripts/0002_data.py (the `e2b/data` and
    `e2b/chart` formatters) and 0003_images.py (Pillow's show and save display the image). Each
    form is best effort: a failure leaves the result without it, never without its display.
    """
    import contextlib
    import datetime
    import functools
    import importlib.abc
    import importlib.machinery
    import json
    import os
    import sys
    import types
    from collections.abc import Callable, Sequence
    from typing import Any

    try:
        from IPython import get_ipython
        from IPython.core.formatters import BaseFormatter, JSONFormatter
        from IPython.display import display
        from traitlets import ObjectName, Unicode
    except ImportError:  # not under IPython: nothing to add a form to
        return
    shell = get_ipython()
    if shell is None:
        return

    # A derived form larger than this (as JSON) is left out in the kernel: it would only be
    # dropped by the result limits further on, after costing the kernel and the wire its size.
    max_form_chars = 4 << 20
    # A DataFrame's columns are not even built past this: at ~18 characters a number, more
    # cells could not fit in `max_form_chars` anyway.
    max_frame_cells = 250_000

    def json_default(value: object) -> object:
        if isinstance(value, datetime.date | datetime.time):
            return value.isoformat()
        return str(value)

    def json_form(value: Any) -> Any:
        """`value` as plain JSON (NaN and infinities as null, other objects as text), or None
        when it is over `max_form_chars` (given up as soon as it is: a huge value costs no more
        than the form may hold). Jupyter's wire refuses what is not strict JSON."""
        if isinstance(value, dict):
            value = {k if isinstance(k, str) else str(k): v for k, v in value.items()}
        parts, size = [], 0
        for chunk in json.JSONEncoder(default=json_default).iterencode(value):
            size += len(chunk)
            if size > max_form_chars:
                return None
            parts.append(chunk)
        return json.loads("".join(parts), parse_constant=lambda _: None)

    class DataFormatter(BaseFormatter):
        """`e2b/data`: a DataFrame's columns, `to_dict(orient="list")` with timestamps in ISO
        form, as E2B's `E2BDataFormatter` gives them."""

        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj: object) -> object:
            try:
                pandas = sys.modules.get("pandas")  # no DataFrame exists without it imported
                if pandas is None or not isinstance(obj, pandas.DataFrame):
                    return super().__call__(obj)
                if obj.size > max_frame_cells or not obj.columns.is_unique:
                    return None  # too big for the form; repeated names would lose columns
                columns = obj.to_dict(orient="list")
                for key, values in columns.items():
                    columns[key] = [
                        v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values
                    ]
                return json_form(columns)
            except Exception:
                return None

    class ChartFormatter(BaseFormatter):
        """`e2b/chart`: a matplotlib figure's chart, as E2B's `E2BChartFormatter` extracts it
        with e2b-charts (`{}` for a blank figure or a failed extraction, as there)."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj: object) -> object:
            try:
                if sys.modules.get("matplotlib") is None:  # no figure exists without it
                    return super().__call__(obj)
                from matplotlib.figure import Figure

                if not isinstance(obj, Figure):
                    return super().__call__(obj)
            except Exception:
                return None
            try:
                from e2b_charts import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
                    chart_figure_to_dict,
                )

                return json_form(chart_figure_to_dict(obj)) or {}
            except Exception:
                return {}

    class ValueJsonFormatter(JSONFormatter):
        """`application/json` for a dict or a list, as E2B's `E2BJSONFormatter` gives it
        (expanded); other objects as IPython does."""

        def __call__(self, obj: object) -> object:
            if isinstance(obj, dict | list):
                try:
                    form = json_form(obj)
                except Exception:
                    return None
                return None if form is None else (form, {"expanded": True})
            return super().__call__(obj)

    formatters = shell.display_formatter.formatters
    formatters["application/json"] = ValueJsonFormatter(parent=shell.display_formatter)
    formatters["e2b/data"] = DataFormatter(parent=shell.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)

    def patch_pillow(image_module: types.ModuleType) -> None:
        """E2B's 0003_images.py: no external viewer is ever started (none could show anything
        here); `Image.show()` displays the image, and so does `Image.save(path)` for a path
        given as text, after writing the file."""
        from PIL import ImageShow

        def show_file(self: object, path: str, **options: Any) -> int:
            return 0

        ImageShow.UnixViewer.show_file = show_file  # type: ignore[method-assign]
        # Only IPython's viewer is left, so a show displays the image once, whatever the host
        # has installed (each Unix viewer would display it again while saving its temporary).
        viewers = getattr(ImageShow, "_viewers", None)
        if isinstance(viewers, list):
            viewers[:] = [v for v in viewers if not isinstance(v, ImageShow.UnixViewer)]
        original_save = image_module.Image.save

        @functools.wraps(original_save)
        def save(image: Any, fp: Any, format: str | None = None, **params: Any) -> None:
            original_save(image, fp, format, **params)
            if isinstance(fp, str):
                display(image)  # type: ignore[no-untyped-call]

        image_module.Image.save = save

    def patch_plotly(renderers_module: types.ModuleType) -> None:
        """A figure's show gives E2B's bundle (plotly's `plotly_mimetype+notebook` default
        there: `application/vnd.plotly.v1+json` and `text/html`) and a PNG when kaleido can
        render one; without kaleido or a browser, no PNG and no error. PLOTLY_RENDERER wins."""
        if os.environ.get("PLOTLY_RENDERER"):
            return
        renderers = renderers_module.renderers

        class FigureWithPng(renderers_module.MimetypeRenderer):  # type: ignore[misc,name-defined]
            def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
                bundle: dict[str, Any] = {}
                for name in ("plotly_mimetype", "notebook"):
                    bundle.update(renderers[name].to_mimebundle(dict(fig_dict)))
                with contextlib.suppress(Exception):
                    bundle.update(renderers["png"].to_mimebundle(dict(fig_dict)))
                return bundle

        renderers["e2b"] = FigureWithPng()
        renderers.default = "e2b"

    def patch_matplotlib_fonts(font_manager: types.ModuleType) -> None:
        """Fonts drawn from memory. FreeType reads a font given by path through a Python file,
        a seek and a read per glyph loaded: 40 text layouts took 117 ms under gVisor (a system
        call costs ~40 us there), 2 ms from memory (4 ms and 1 ms on a host). Each font file is
        read once (256 MiB at most kept); a font reads a view of its bytes that stands for its
        path where matplotlib asks `fname` for one (`str()` for PDF embedding, cache keys).
        Not path-like: FreeType would open a path-like object as a file again. Only where
        matplotlib takes a font's path through `FontPath` (3.11 on): older releases use
        `fname` as a path of their own (measured: 3.8's PDF and PS output fail with it)."""
        import io

        original = getattr(font_manager, "_get_font", None)
        if original is None or not hasattr(font_manager, "FontPath"):
            return
        kept: dict[str, bytes] = {}

        class FontBytes(io.BytesIO):  # shares the bytes it is given, never written
            def __init__(self, data: bytes, path: str) -> None:
                super().__init__(data)
                self.name = path

            def __str__(self) -> str:
                return str(self.name)

            def __eq__(self, other: object) -> bool:
                return bool(self.name == (other.name if isinstance(other, FontBytes) else other))

            def __hash__(self) -> int:
                return hash(self.name)

        def in_memory(path: Any) -> Any:
            data = kept.get(path) if isinstance(path, str) else b""
            if data is None:
                room = (256 << 20) - sum(map(len, kept.values()))
                with contextlib.suppress(OSError), open(path, "rb") as f:  # else FreeType says
                    data = kept[path] = f.read(room + 1)
                if data is None or len(data) > room:
                    kept.pop(path, None)
                    return path
            return FontBytes(data, path) if data else path

        @functools.wraps(original)
        def get_font(font_filepaths: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
            # The same cache key as given: (path, face index) pairs (3.11), paths before.
            return original(
                tuple(
                    (in_memory(p[0]), *p[1:]) if isinstance(p, tuple) else in_memory(p)
                    for p in font_filepaths
                ),
                *args,
                **kwargs,
            )

        def cache_clear() -> None:  # "a font file changed": the bytes kept go too
            kept.clear()
            original.cache_clear()

        get_font.cache_clear = cache_clear  # type: ignore[attr-defined]
        get_font.cache_info = original.cache_info  # type: ignore[attr-defined]
        font_manager._get_font = get_font  # type: ignore[attr-defined]

    def boxplot_taking_labels(original: Callable[..., Any]) -> Callable[..., Any]:
        """`boxplot` that takes `labels=` (matplotlib 3.9 renamed it `tick_labels`, 3.11 removed
        it) as E2B's template (3.10) does: model-written code and E2B's chart examples pass it."""
        import inspect

        taken = inspect.signature(original).parameters
        if "labels" in taken or "tick_labels" not in taken:
            return original  # a matplotlib that takes `labels` itself

        @functools.wraps(original)
        def boxplot(*args: Any, labels: Any = None, **kwargs: Any) -> Any:
            if labels is not None:
                if kwargs.get("tick_labels") is not None:
                    raise TypeError("boxplot() takes labels or tick_labels, not both")
                kwargs["tick_labels"] = labels
            return original(*args, **kwargs)

        return boxplot

    def patch_axes(axes: types.ModuleType) -> None:
        axes.Axes.boxplot = boxplot_taking_labels(axes.Axes.boxplot)

    def patch_pyplot(pyplot: types.ModuleType) -> None:
        setattr(pyplot, "boxplot", boxplot_taking_labels(pyplot.boxplot))  # noqa: B010

    patches: dict[str, Callable[[types.ModuleType], None]] = {
        "matplotlib.axes": patch_axes,
        "matplotlib.pyplot": patch_pyplot,
        "matplotlib.font_manager": patch_matplotlib_fonts,
        "PIL.Image": patch_pillow,
        "plotly.io._renderers": patch_plotly,
    }

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        """Applies a patch right after its module is first imported: the kernel starts without
        importing any of these libraries, and code that never uses them pays nothing."""

        def find_spec(
            self,
            fullname: str,
            path: Sequence[str] | None,
            target: types.ModuleType | None = None,
        ) -> importlib.machinery.ModuleSpec | None:
            patch = patches.get(fullname)  # taken when the module is really loaded, not probed
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
            else:
                return None
            loader = spec.loader
            run = getattr(loader, "exec_module", None)
            if run is None:
                return spec

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                if patches.pop(fullname, None) is not None:
                    with contextlib.suppress(Exception):
                        patch(module)

            with contextlib.suppress(AttributeError):  # this spec's own loader only
                loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
            return spec

    sys.meta_path.insert(0, PatchAfterImport())
    for name in [n for n in patches if n in sys.modules]:  # imported before this file ran
        with contextlib.suppress(Exception):
            patches.pop(name)(sys.modules[name])


try:
    _install_e2b_display_forms()
except Exception:
    __import__("logging").getLogger(__name__).debug("display forms unavailable", exc_info=True)
del _install_e2b_display_forms
