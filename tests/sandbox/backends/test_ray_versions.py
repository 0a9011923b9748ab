"""The ray backend reads Ray's private state API: a Ray it was not tested with is said once."""

from __future__ import annotations

import logging

import pytest
import ray

from sandbox.backends.ray_cluster import cluster_state
from sandbox.backends.ray_cluster.cluster_state import untested_ray

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("version", "untested"),
    [("2.55.0", False), ("2.60.1", False), ("2.54.9", True), ("2.61.0", True), ("3.0", True)],
)
def test_versions_outside_the_tested_range_are_said(
    version: str, untested: bool, caplog: pytest.LogCaptureFixture
) -> None:
    untested_ray.cache_clear()
    with caplog.at_level(logging.WARNING, logger=cluster_state.__name__):
        assert untested_ray(version) is untested
        untested_ray(version)
    said = [r for r in caplog.records if "not a version the ray backend was tested" in r.message]
    assert len(said) == (1 if untested else 0)


def test_the_installed_ray_is_a_tested_one() -> None:
    """pyproject.toml's Ray and TESTED_RAY move together: raise one, test, raise the other."""
    untested_ray.cache_clear()
    assert not untested_ray(ray.__version__)


def test_a_version_that_cannot_be_read_is_untested() -> None:
    untested_ray.cache_clear()
    assert untested_ray("nightly")
