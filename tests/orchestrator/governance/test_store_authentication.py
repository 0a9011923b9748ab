"""The service keeps its keys and audit log only in a Redis that demands a password (issue 28,
item 1): a store URL without one is refused before anything connects, a Redis that answers a
connection without one is refused at start, and the operator's opt-out
(`store_allow_unauthenticated`) starts it anyway, saying so in the log. Real `serve` processes
and real redis-servers, all on 127.0.0.1."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from orchestrator.state_store.redis_auth import UnauthenticatedStore
from tests.cluster.redis_server import redis_server
from tests.orchestrator.governance.store_handles import shared_store
from tests.orchestrator.service.conftest import Server, make_server

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)


@pytest.fixture(scope="module")
def open_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server on 127.0.0.1 with no password at all (what the attack found)."""
    with redis_server(tmp_path_factory.mktemp("open-redis"), password="") as url:
        yield url


@pytest.fixture
def clustered() -> Iterator[Callable[..., Server]]:
    """Servers (not started) keeping their records in the store at a URL (their sessions on
    local); their directories are removed after the test."""
    made: list[Server] = []

    def server(store_url: str, **settings: object) -> Server:
        made.append(
            make_server(
                store_url=store_url,
                store_prefix=f"p{uuid.uuid4().hex[:8]}",
                backends="local",
                default_backend="local",
                **settings,
            )
        )
        return made[-1]

    yield server
    for server_made in made:
        shutil.rmtree(server_made.state_dir.parent, ignore_errors=True)
        server_made.log.unlink(missing_ok=True)


def refused_start(server: Server) -> str:
    """Start a server that must not start; its log."""
    with pytest.raises(RuntimeError, match="the server exited"):
        server.start()
    assert server.process is not None and server.process.returncode != 0
    return server.log.read_text()


def connections(url: str) -> int:
    """How many connections the Redis has taken so far (this one included)."""
    return int(redis.Redis.from_url(url).info("stats")["total_connections_received"])


def test_a_store_url_without_a_password_is_refused_before_connecting(
    open_redis: str, clustered: Callable[..., Server]
) -> None:
    before = connections(open_redis)
    log = refused_start(clustered(open_redis))
    assert "error: the store URL (redis://127.0.0.1:" in log and "has no password" in log
    # It says how to fix it: a password in the URL, or the opt-out.
    assert "requirepass" in log and "redis://:PASSWORD@HOST:PORT/DB" in log
    assert "redis://USER:PASSWORD@HOST:PORT/DB" in log
    assert "CODE_INTERPRETER_STORE_ALLOW_UNAUTHENTICATED=true" in log
    assert "Traceback" not in log
    assert connections(open_redis) == before + 1  # only the count's own connection


def test_the_keys_cli_refuses_it_too(open_redis: str) -> None:
    result = CliRunner().invoke(cli_app, ["keys", "list", "--store", open_redis])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: the store URL") and "has no password" in line


async def test_a_redis_that_answers_without_a_password_is_refused(
    open_redis: str, clustered: Callable[..., Server], tmp_path: Path
) -> None:
    """An ACL user with a password in the URL, but the server's default user still open: the
    password protects nothing, and the start says so."""
    user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis.Redis.from_url(open_redis)
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    admin.close()
    with_user = open_redis.replace("redis://", f"redis://{user}:{password}@")
    log = refused_start(clustered(with_user))
    assert "answers a connection that sends no password" in log
    assert password not in log
    store = shared_store(with_user, snapshots_dir=tmp_path)
    with pytest.raises(UnauthenticatedStore, match="ACL SETUSER default off"):
        await store.connection.ping()
    await store.close()


def test_the_opt_out_starts_it_and_warns(open_redis: str, clustered: Callable[..., Server]) -> None:
    server = clustered(open_redis, store_allow_unauthenticated="true").start()
    try:
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    finally:
        server.stop()
    log = server.log.read_text()
    assert "WARNING" in log and "takes connections without a password" in log
    assert "store_allow_unauthenticated" in log


def test_a_redis_with_a_password_starts_without_a_warning(
    clustered: Callable[..., Server], tmp_path: Path
) -> None:
    with redis_server(tmp_path / "redis") as url:
        assert url.startswith("redis://:")
        server = clustered(url).start()
        try:
            assert httpx.get(f"{server.url}/healthz").status_code == 200
        finally:
            server.stop()
    log = server.log.read_text()
    password = url.split("@")[0].removeprefix("redis://:")
    assert "without a password" not in log and password not in log


async def test_a_locked_down_default_user_with_an_acl_user_is_accepted(tmp_path: Path) -> None:
    """A default user left on without a password but allowed no command (`-@all`) answers
    nothing to a connection without a password (NOPERM): the ACL user's password guards the
    store, and the store starts."""
    with redis_server(tmp_path / "redis", password="") as open_url:
        user, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        admin = redis.Redis.from_url(open_url)
        admin.acl_setuser(
            user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
        )
        admin.acl_setuser("default", enabled=True, nopass=True, commands=["-@all"])
        admin.close()
        store = shared_store(
            open_url.replace("redis://", f"redis://{user}:{password}@"), snapshots_dir=tmp_path
        )
        try:
            await store.connection.ping()
        finally:
            await store.close()
