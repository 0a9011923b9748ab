"""The session lists read the store off the event loop: GET /v1/sessions, E2B's sandbox list
and the console's sessions list and session page (polled every few seconds by each open tab)
wait for a slow store (Redis in cluster mode may take up to its timeout; here another thread
holds the SQLite store, as a long write does) while the service goes on answering everything
else."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import httpx

from orchestrator.app import create_app
from orchestrator.config import Settings
from orchestrator.service import Service
from orchestrator.state_store import SqliteStore

T = TypeVar("T")
KEY = "key-lists-" + "0" * 24
HOLD_S = 1.0  # how long the store is held
MOST_STALL_S = 0.3  # the longest the event loop may stand still meanwhile
TICK_S = 0.02


@asynccontextmanager
async def app_client() -> AsyncIterator[httpx.AsyncClient]:
    """The whole app in this process (its service on this event loop), local sessions, no
    reaper round meanwhile (its own store reads are not under test here); logged in to the
    console too."""
    root = Path(tempfile.mkdtemp(prefix="cir-lists-", dir="/tmp"))
    root.chmod(0o711)  # sandboxes run as another uid: they enter the state dir
    app = create_app(
        Settings(
            admin_keys=[KEY],
            backends=["local"],
            default_backend="local",
            state_dir=root / "state",
            reap_interval_s=3600,
        )
    )
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://127.0.0.1",
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=60,
            ) as client,
        ):
            logged_in = await client.post("/console/login", data={"key": KEY})
            assert logged_in.status_code == 303, logged_in.text
            yield client
    finally:
        shutil.rmtree(root, ignore_errors=True)


def service_of(client: httpx.AsyncClient) -> Service:
    transport = client._transport
    assert isinstance(transport, httpx.ASGITransport)
    service: Service = transport.app.state.service  # type: ignore[attr-defined]
    return service


async def while_the_store_is_held(service: Service, work: Awaitable[T]) -> tuple[T, float, float]:
    """(what `work` gave, how long it took, the event loop's longest stall meanwhile), with
    another thread holding the store for HOLD_S from just before it starts."""
    store = service.persistence.store
    assert isinstance(store, SqliteStore)
    held = threading.Event()

    def hold() -> None:
        with store.database.lock:  # as a long write on another thread does
            held.set()
            time.sleep(HOLD_S)

    holder = threading.Thread(target=hold)
    holder.start()
    await asyncio.to_thread(held.wait)
    loop = asyncio.get_running_loop()
    longest = 0.0
    done = False

    async def tick() -> None:
        nonlocal longest
        last = loop.time()
        while not done:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            longest = max(longest, now - last - TICK_S)
            last = now

    ticking = asyncio.ensure_future(tick())
    await asyncio.sleep(0)  # the ticker starts first: a stall from the work's first step counts
    started = time.monotonic()
    try:
        result = await work
    finally:
        done = True
        await ticking
        await asyncio.to_thread(holder.join)
    return result, time.monotonic() - started, longest


async def test_the_session_lists_wait_for_the_store_without_stalling_the_service() -> None:
    async with app_client() as client:
        created = await client.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            paused = await client.post(f"/v1/sessions/{sid}/pause")  # known from its record
            assert paused.status_code == 200, paused.text
            service = service_of(client)
            pages = ["/v1/sessions", "/v2/sandboxes", "/console/sessions/list"]
            for page in [*pages, f"/console/sessions/{sid}"]:
                answer, took, stall = await while_the_store_is_held(service, client.get(page))
                assert answer.status_code == 200, (page, answer.text)
                assert sid in answer.text, page
                assert took >= HOLD_S / 2, f"{page} did not read the store: the test shows nothing"
                assert stall < MOST_STALL_S, f"{page}: the event loop stood still {stall:.2f} s"
        finally:
            await client.delete(f"/v1/sessions/{sid}")
