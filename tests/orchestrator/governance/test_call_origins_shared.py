"""Across replicas (cluster mode), a call's origin is found in the shared store: a replica that
takes a call of code another replica runs serves it, and shows its code, only while it runs.
Two registries on one real Redis on 127.0.0.1, as two replicas hold it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.governance.call_origins import CallOrigins, SharedOrigins, refusal_text
from orchestrator.governance.stores.origin_record import OriginRecord
from tests.orchestrator.governance.store_handles import StoreHandle, shared_store


async def test_an_origin_running_on_one_replica_is_found_by_another_until_it_ends(
    redis_url: str, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    one = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    other = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    here, there = CallOrigins(lambda: one.origins), CallOrigins(lambda: other.origins)
    try:
        entry = await here.open("s-1", "execution", "print('the code')", 30, shared=True)
        assert entry.origin.startswith("exec-") and entry.shared
        found = await there.caller("s-1", entry.origin)
        assert found is not None and found.kind == "execution" and found.entry is None
        assert found.code == "print('the code')"
        assert await there.caller("s-2", entry.origin) is None  # another session's: not found

        unshared = await here.open("s-1", "command", "ls", 30)  # a session without tools
        assert await there.caller("s-1", unshared.origin) is None

        here.end(entry)
        assert await here.caller("s-1", entry.origin) is None  # at once, here
        deadline = time.monotonic() + 10
        while await there.caller("s-1", entry.origin) is not None:  # the delete is off the loop
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert "has ended" in refusal_text(entry.origin) and entry.origin in refusal_text(
            entry.origin
        )
        # The time to live: a replica that dies leaves nothing running for long.
        ttl = await one.connection.client.ttl(f"{prefix}:origin:s-1:{unshared.origin}")
        assert ttl == -2  # never written
        left = await here.open("s-1", "process", "sleep 1", 5, shared=True)
        assert 0 < await one.connection.client.ttl(f"{prefix}:origin:s-1:{left.origin}") <= 60
    finally:
        await here.close()
        await there.close()
        await one.close()
        await other.close()


@pytest.fixture
async def stores(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[StoreHandle, StoreHandle]]:
    """Two replicas' handles on one store, under a prefix of the test's own."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    one = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    other = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    yield one, other
    await one.close()
    await other.close()


async def test_a_running_origin_outlives_its_time_to_live_in_the_store(
    stores: tuple[StoreHandle, StoreHandle],
) -> None:
    """The time to live is renewed while the origin runs here, so one that waited long for its
    kernel (executions queue on it) is still found by the other replica; once it ends, it goes."""
    one, other = stores
    here = CallOrigins(lambda: one.origins, shared_ttl_s=2, shared_refresh_s=0.2)
    there = CallOrigins(lambda: other.origins)
    try:
        entry = await here.open("s-1", "execution", "queued()", 1, shared=True)
        key = one.connection.key("origin", "s-1", entry.origin)
        assert 0 < await one.connection.client.pttl(key) <= 2000
        until = time.monotonic() + 5  # past twice its time to live and its time limit
        while time.monotonic() < until:
            assert await there.caller("s-1", entry.origin) is not None
            await asyncio.sleep(0.1)
        here.end(entry)
        deadline = time.monotonic() + 10
        while await there.caller("s-1", entry.origin) is not None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert await here.refresh() == 0  # nothing of it left to renew
        assert await one.connection.client.exists(key) == 0
    finally:
        await here.close()
        await there.close()


class HeldWrites:
    """The store's origins, whose writes wait until the test lets them through (a write the
    store is slow to answer), telling which origin each is for."""

    def __init__(self, origins: SharedOrigins) -> None:
        self._origins = origins
        self.writing: list[str] = []
        self.arrived = asyncio.Event()
        self.go_on = asyncio.Event()

    async def put_origin(
        self, session_id: str, origin: str, record: OriginRecord, ttl_s: float
    ) -> None:
        self.writing.append(origin)
        self.arrived.set()
        await asyncio.wait_for(self.go_on.wait(), 30)
        await self._origins.put_origin(session_id, origin, record, ttl_s)

    async def get_origin(self, session_id: str, origin: str) -> OriginRecord | None:
        return await self._origins.get_origin(session_id, origin)

    async def delete_origin(self, session_id: str, origin: str) -> None:
        await self._origins.delete_origin(session_id, origin)

    async def refresh_origins(self, origins: list[tuple[str, str]], ttl_s: float) -> None:
        await self._origins.refresh_origins(origins, ttl_s)


async def test_an_origin_whose_opening_is_cancelled_runs_nothing_and_leaves_nothing(
    stores: tuple[StoreHandle, StoreHandle],
) -> None:
    """Its caller left while it was being written to the store: it is not running here, and
    once the write is done it is deleted there too."""
    one, other = stores
    held = HeldWrites(one.origins)
    here, there = CallOrigins(lambda: held), CallOrigins(lambda: other.origins)
    try:
        opening = asyncio.ensure_future(here.open("s-1", "execution", "x()", 30, shared=True))
        await asyncio.wait_for(held.arrived.wait(), 30)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        [origin] = held.writing
        assert await here.caller("s-1", origin) is None
        held.go_on.set()  # the write lands now; the delete follows it
        deadline = time.monotonic() + 10
        while await one.connection.client.exists(one.connection.key("origin", "s-1", origin)):
            assert time.monotonic() < deadline, "the origin's record was left in the store"
            await asyncio.sleep(0.02)
        assert await there.caller("s-1", origin) is None
    finally:
        held.go_on.set()
        await here.close()
        await there.close()


async def test_the_end_of_a_session_stops_following_its_processes() -> None:
    """A background process's origin ends when the process does, or with its session: then
    nothing is left waiting for the process."""
    origins = CallOrigins()
    try:
        entry = await origins.open("s-1", "process", "sleep 1000", None)
        process_ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        origins.end_after(entry, process_ended)
        await asyncio.sleep(0)  # the follower waits for the process now
        origins.forget_session("s-1")
        assert await origins.caller("s-1", entry.origin) is None
        for _ in range(3):
            await asyncio.sleep(0)
        assert process_ended.cancelled()  # nothing waits on it any more
    finally:
        await origins.close()


async def test_an_origin_whose_session_ends_while_it_is_written_is_deleted_once_written(
    stores: tuple[StoreHandle, StoreHandle],
) -> None:
    one, other = stores
    held = HeldWrites(one.origins)
    here, there = CallOrigins(lambda: held), CallOrigins(lambda: other.origins)
    try:
        opening = asyncio.ensure_future(here.open("s-1", "execution", "x()", 30, shared=True))
        await asyncio.wait_for(held.arrived.wait(), 30)
        [origin] = held.writing
        here.forget_session("s-1")  # the session ends before the write lands
        held.go_on.set()
        await opening
        deadline = time.monotonic() + 10
        while await there.caller("s-1", origin) is not None:
            assert time.monotonic() < deadline, "an ended origin was left running in the store"
            await asyncio.sleep(0.02)
    finally:
        held.go_on.set()
        await here.close()
        await there.close()
