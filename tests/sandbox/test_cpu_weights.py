"""The sandboxes' parent cgroup weighs as many processes as there are live sandboxes under it
(sandbox/cgroups.py `rescale_parent`): real cgroup v1 groups, made by the test under a parent
of its own so that other tests' sandboxes do not change the count."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox import cgroups
from sandbox.cgroups import BACKGROUND_SHARES, LIVE_SHARES, MAX_SHARES, rescale_parent

pytestmark = pytest.mark.skipif(
    not cgroups.available() and not os.environ.get("CI"),
    reason="needs root and writable cgroup v1 hierarchies",
)


@pytest.fixture
def parent() -> Iterator[Path]:
    path = cgroups.ROOT / "cpu" / f"cir-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        for child in path.iterdir():
            if child.is_dir():
                child.rmdir()
        path.rmdir()


def child(parent: Path, shares: int) -> Path:
    path = parent / uuid.uuid4().hex[:8]
    path.mkdir()
    (path / "cpu.shares").write_text(str(shares))
    return path


def shares(path: Path) -> int:
    return int((path / "cpu.shares").read_text())


def weight_of(live: int) -> int:
    """One live session's weight per live sandbox, at least one's, at most one per core."""
    return LIVE_SHARES * min(max(1, live), os.cpu_count() or 1, MAX_SHARES // LIVE_SHARES)


def test_the_parent_weighs_one_live_session_per_live_sandbox(parent: Path) -> None:
    assert rescale_parent(parent) == LIVE_SHARES  # none: at least one's
    assert shares(parent) == LIVE_SHARES
    first, second = child(parent, LIVE_SHARES), child(parent, LIVE_SHARES)
    child(parent, BACKGROUND_SHARES)  # warming in a pool: adds nothing
    assert rescale_parent(parent) == weight_of(2) == shares(parent)
    (second / "cpu.shares").write_text(str(BACKGROUND_SHARES))
    assert rescale_parent(parent) == LIVE_SHARES
    first.rmdir()
    assert rescale_parent(parent) == LIVE_SHARES  # still at least one's


def test_the_parent_weighs_at_most_one_live_session_per_core(parent: Path) -> None:
    cores = os.cpu_count() or 1
    for _ in range(cores + 3):
        child(parent, LIVE_SHARES)
    assert rescale_parent(parent) == weight_of(cores + 3) == LIVE_SHARES * cores
    assert shares(parent) == LIVE_SHARES * cores


def test_no_parent_group_is_no_weight() -> None:
    assert rescale_parent(cgroups.ROOT / "cpu" / f"cir-absent-{uuid.uuid4().hex}") is None
