"""MCP connections' store, on one machine and shared (a real redis-server): a connection's
session is bound once however many calls race for it, an ended one stays ended for every
replica, and what a client sent is kept only within its cap."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from orchestrator.mcp_connections import (
    MAX_ANSWER_BYTES,
    MAX_ANSWERS_WAITING,
    MAX_CLIENT_BYTES,
    LocalMcpConnections,
    McpConnection,
    McpConnections,
    SharedMcpConnections,
)
from orchestrator.state_store.redis_connection import RedisConnection

pytestmark = pytest.mark.unit
CLIENT = {"protocolVersion": "2025-06-18", "capabilities": {"elicitation": {}}}


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[list[McpConnections]]:
    """Two replicas' handles on one shared store."""
    prefix = f"c{uuid.uuid4().hex[:8]}"
    connections = [RedisConnection(redis_url, prefix=prefix) for _ in range(2)]
    yield [SharedMcpConnections(c, keep_s=60) for c in connections]
    for connection in connections:
        await connection.close()


@pytest.fixture(params=["local", "shared"])
def both(request: pytest.FixtureRequest) -> list[McpConnections]:
    """The two stores; the local one's `replicas` are one process's handle twice."""
    if request.param == "local":
        local = LocalMcpConnections(keep_s=60)
        return [local, local]
    found: list[McpConnections] = request.getfixturevalue("replicas")
    return found


async def test_a_connections_session_is_bound_once(both: list[McpConnections]) -> None:
    a, b = both
    await a.opened("c1", "owner", CLIENT)
    assert await a.bind("c1", "owner", "s-first", None) == "s-first"
    assert await b.bind("c1", "owner", "s-second", None) == "s-first"  # lost the race
    # Its session expired: the next call's new one replaces exactly that one.
    assert await b.bind("c1", "owner", "s-new", "s-first") == "s-new"
    assert await a.bind("c1", "owner", "s-other", "s-first") == "s-new"
    found = await b.get("c1")
    assert isinstance(found, McpConnection)
    assert (found.owner, found.session_id) == ("owner", "s-new")


async def test_another_owner_cannot_bind_a_connection(both: list[McpConnections]) -> None:
    """A request of another key naming the connection (a header no transport checked) binds
    nothing, and changes nothing of the owner's."""
    a, b = both
    await a.opened("c1", "owner", CLIENT)
    assert await a.bind("c1", "owner", "s-mine", None) == "s-mine"
    assert await b.bind("c1", "stranger", "s-theirs", None) is None
    assert await b.bind("c1", "stranger", "s-theirs", "s-mine") is None
    found = await a.get("c1")
    assert isinstance(found, McpConnection) and found.session_id == "s-mine"


async def test_an_ended_connection_is_ended_for_every_replica(
    replicas: list[McpConnections],
) -> None:
    a, b = replicas
    await a.opened("c1", "owner", CLIENT)
    await a.bind("c1", "owner", "s1", None)
    assert await b.forget("c1") == McpConnection("owner", CLIENT, "s1")
    assert await a.get("c1") == "ended"
    assert await a.bind("c1", "owner", "s2", None) is None  # a call racing the end keeps none
    assert await a.forget("c1") is None


async def test_a_connection_never_opened_over_http_is_made_by_its_first_bind(
    both: list[McpConnections],
) -> None:
    """stdio's: one connection per process, never `opened`."""
    a, _ = both
    assert await a.get("stdio-x") is None
    assert await a.bind("stdio-x", "local", "s1", None) == "s1"
    assert await a.get("stdio-x") == McpConnection("local", None, "s1")


async def test_what_a_client_said_is_kept_within_its_cap(
    replicas: list[McpConnections],
) -> None:
    """For another replica to continue its connection; one too large is kept without it."""
    a, b = replicas
    await a.opened("c1", "owner", CLIENT)
    assert await b.get("c1") == McpConnection("owner", CLIENT, None)
    await a.opened("c2", "owner", {"padding": "x" * MAX_CLIENT_BYTES})
    assert await b.get("c2") == McpConnection("owner", None, None)


async def test_one_process_keeps_nothing_a_client_said() -> None:
    """On one machine nothing else continues a connection: its client's words are not kept."""
    local = LocalMcpConnections(keep_s=60)
    await local.opened("c1", "owner", CLIENT)
    assert await local.get("c1") == McpConnection("owner", None, None)


async def test_one_process_forgets_connections_idle_past_their_timeout() -> None:
    local = LocalMcpConnections(keep_s=0.05)
    await local.opened("c1", "owner", None)
    await asyncio.sleep(0.1)  # past the idle timeout
    assert await local.get("c1") is None


async def test_an_answer_is_kept_for_each_other_replica_waiting(
    replicas: list[McpConnections],
) -> None:
    """An answer a client sends through one replica is kept for every other replica waiting
    on its connection (never for the one it came through, which had it), each taking it once;
    for nobody once they wait no more; never past its caps."""
    a, b = replicas
    assert a.answers_travel and b.answers_travel
    assert await b.pass_on("c1", "rb", b'{"id": 1}') == 0  # nobody waits: nothing kept
    await a.awaiting("c1", "ra", 1)
    await a.awaiting("c1", "ra", 1)  # two questions at once through one replica
    await b.awaiting("c1", "rb", 1)
    await a.awaiting("c1", "rc", 1)
    assert await b.pass_on("c1", "rb", b'{"id": 2}') == 2  # for ra and rc, not rb
    assert await a.passed_on("c1", "ra") == [b'{"id": 2}']
    assert await a.passed_on("c1", "ra") == []  # taken once
    assert await b.passed_on("c1", "rb") == []
    assert await b.passed_on("c2", "rc") == []  # another connection's: none
    assert await b.passed_on("c1", "rc") == [b'{"id": 2}']

    assert await b.pass_on("c1", "rb", b"x" * (MAX_ANSWER_BYTES + 1)) == 0  # too large
    for n in range(MAX_ANSWERS_WAITING + 5):
        await b.pass_on("c1", "rb", str(n).encode())
    kept = await a.passed_on("c1", "ra")  # the latest, at most the cap
    assert kept == [str(n).encode() for n in range(5, MAX_ANSWERS_WAITING + 5)]

    for replica, times in (("ra", 2), ("rb", 1), ("rc", 1)):
        for _ in range(times):
            await a.awaiting("c1", replica, -1)
    assert await b.pass_on("c1", "rd", b'{"id": 3}') == 0  # nobody waits any more


async def test_one_process_passes_no_answer_on() -> None:
    local = LocalMcpConnections(keep_s=60)
    assert not local.answers_travel
    await local.awaiting("c1", "ra", 1)
    assert await local.pass_on("c1", "rb", b'{"id": 1}') == 0
    assert await local.passed_on("c1", "ra") == []
