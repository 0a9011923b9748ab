"""The display forms file has matplotlib draw text from fonts held in memory: FreeType otherwise
reads a font file through a seek and a read for every glyph it loads, and a system call is dear in a
gVisor machine (docs/gvisor.md). What is drawn must not change: the same PNG byte for byte, PDF
and SVG output as before, the font's path where matplotlib asks a font for one.

Run in child interpreters with IPython's shell, one with the display forms file, one without."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.sandbox.inside_kernel.forms_shell import LOAD_FORMS, SHELL

pytestmark = pytest.mark.unit


DRAW = f"""
import hashlib, io, json, os, sys, threading
{SHELL}if sys.argv[1] == "with-forms":
    {LOAD_FORMS}import matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
from matplotlib import font_manager

def draw(title):
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [4, 1, 9])
    ax.set_title(title)
    ax.set_xlabel("day")
    out = {{}}
    for form in ("png", "pdf", "svg"):
        buf = io.BytesIO()
        fig.savefig(buf, format=form)
        out[form] = buf.getvalue()
    plt.close(fig)
    return out

drawn = draw("units by day")
in_thread = []
worker = threading.Thread(target=lambda: in_thread.append(draw("units by day")))
worker.start()
worker.join()
path = font_manager.findfont("DejaVu Sans")
font = font_manager.get_font(path)
open_fonts = sorted(
    os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
    if os.path.exists(f"/proc/self/fd/{{fd}}")
    and os.readlink(f"/proc/self/fd/{{fd}}") == os.path.realpath(path)
)
# A font file changed: matplotlib's own recipe to see it, which must clear the bytes kept too.
font_manager._get_font.cache_clear()
after_clear = font_manager.get_font(path)
print(json.dumps({{
    "cleared_is_new": after_clear is not font,
    "png": hashlib.sha256(drawn["png"]).hexdigest(),
    "png_in_thread": hashlib.sha256(in_thread[0]["png"]).hexdigest(),
    "pdf_embeds_font": b"DejaVuSans" in drawn["pdf"],
    "pdf_bytes": len(drawn["pdf"]),
    "svg_has_title": b"units by day" in drawn["svg"] or b"<!-- units by day -->" in drawn["svg"],
    "fname": str(font.fname),
    "path": os.path.realpath(path),
    "open_fonts": open_fonts,
}}))
"""


def drawn(mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", DRAW, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_fonts_are_drawn_from_memory_and_the_drawing_is_the_same() -> None:
    plain, patched = drawn("plain"), drawn("with-forms")
    # Without the display forms file matplotlib keeps the font file open to read glyphs from it;
    # (one for each thread that drew); with it, the font's bytes were read once, the file closed.
    assert plain["open_fonts"] and set(plain["open_fonts"]) == {plain["path"]}
    assert patched["open_fonts"] == []
    # The same drawing, byte for byte, on the main thread and on another one.
    assert patched["png"] == plain["png"] == patched["png_in_thread"]
    # PDF embeds the font by its path (matplotlib asks the font for it): still there.
    assert patched["pdf_embeds_font"] and plain["pdf_embeds_font"]
    assert patched["pdf_bytes"] == plain["pdf_bytes"]
    assert patched["svg_has_title"]
    assert patched["fname"] == patched["path"]
    assert patched["cleared_is_new"] and plain["cleared_is_new"]
