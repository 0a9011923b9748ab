"""Where a run's report goes, and which earlier run it is compared with.

Pure logic only, in a directory of the test's own; no run is measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import report
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "chart", lambda data, path: path.write_bytes(b"png"))
    return tmp_path


def _run(kind: str, date: str) -> dict[str, Any]:
    return minimal_report(kind=kind, date=date)


def test_a_run_is_compared_with_the_last_run_of_its_kind(results: Path) -> None:
    report.write(_run("default", "first"))
    assert "No earlier run of this kind" in (results / "latest.md").read_text()
    report.write(_run("default", "second"))
    assert json.loads((results / "previous.json").read_text())["date"] == "first"
    assert "The previous `default` run (first)" in (results / "latest.md").read_text()


def test_a_quick_run_keeps_files_of_its_own(results: Path) -> None:
    report.write(_run("default", "kept"))
    report.write(_run("quick", "smoke"))
    assert json.loads((results / "latest.json").read_text())["date"] == "kept"
    assert json.loads((results / "quick.json").read_text())["date"] == "smoke"
    assert (results / "quick.md").exists() and (results / "quick.png").exists()
    report.write(_run("default", "next"))  # compared with the default run, not the quick one
    assert "The previous `default` run (kept)" in (results / "latest.md").read_text()


def test_an_unreadable_last_run_loses_nothing_of_the_new_one(results: Path) -> None:
    (results / "latest.json").write_text("{ cut short")
    report.write(_run("default", "new"))
    assert json.loads((results / "latest.json").read_text())["date"] == "new"
    assert not (results / "previous.json").exists()


def test_a_run_is_shown_again_as_it_was_compared(results: Path) -> None:
    report.write(_run("default", "first"))
    report.write(_run("default", "second"))
    (results / "latest.md").unlink()
    report.rerender()
    assert "The previous `default` run (first)" in (results / "latest.md").read_text()


def test_horizontal_boxes_in_this_matplotlib_s_words() -> None:
    assert report._horizontal("3.9.4") == {"vert": False}
    assert report._horizontal("3.10.0") == {"orientation": "horizontal"}
    assert report._horizontal("3.11rc1") == {"orientation": "horizontal"}
    assert report._horizontal("unknown") == {"orientation": "horizontal"}
