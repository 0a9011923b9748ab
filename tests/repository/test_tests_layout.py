"""The tests mirror the source: a module's tests are found by its path (docs/architecture.md,
"Tests"), so no test file lies loose at tests/, and none is named after how it came to be (a
review, a round) rather than after the behaviour it checks."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_lies_loose_at_the_top_of_tests() -> None:
    loose = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert not loose, f"move these beside the tests of the module they test: {loose}"


def test_no_test_file_is_named_after_a_review() -> None:
    named = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if "review" in path.name.lower()
    )
    assert not named, f"name these after the behaviour they test: {named}"
