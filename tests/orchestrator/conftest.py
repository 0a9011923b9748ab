"""Fixtures for the service's tests and its parts' (governance's, the stores')."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 for this worker's tests; each test keeps to a key
    prefix of its own. Required in CI (scripts/install-system-packages.sh installs it)."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server must be installed in CI (scripts/install-system-packages.sh)")
        pytest.skip("redis-server is not installed")
    from tests.cluster.redis_server import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
