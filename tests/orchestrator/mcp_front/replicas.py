"""Two real `serve` processes sharing a real Redis (their sessions on the local backend): the
replicas of a cluster, as far as MCP connections are concerned."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tests.orchestrator.service.conftest import Server, make_server


@contextmanager
def two_replicas(redis_url: str, **settings: object) -> Iterator[tuple[Server, Server]]:
    """Started with `settings` besides, each under a store prefix of their own pair; stopped
    and their state removed after."""
    prefix = f"m{uuid.uuid4().hex[:8]}"
    made: list[Server] = []
    try:
        for _ in range(2):
            made.append(
                make_server(
                    store_url=redis_url,
                    store_prefix=prefix,
                    backends="local",
                    default_backend="local",
                    **settings,
                ).start()
            )
        yield made[0], made[1]
    finally:
        for server in made:
            server.stop()
            shutil.rmtree(server.state_dir.parent, ignore_errors=True)
