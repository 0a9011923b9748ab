"""Fixtures for the service's tests and its parts' (governance's, the stores')."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def store_refusing(redis_url: str) -> Iterator[str]:
    """While held, the redis-server refuses every client but the test's own: its password is
    changed and the other connections are dropped (then restored). Yields the real password
    (an error message must never show it)."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    try:
        password = str(admin.config_get("requirepass")["requirepass"])
        admin.config_set("requirepass", password + "-changed")
        try:
            admin.client_kill_filter(_type="normal", skipme=True)
            yield password
        finally:
            admin.config_set("requirepass", password)
    finally:
        admin.close()
