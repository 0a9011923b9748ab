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
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from orchestrator.app import create_app
from orchestrator.config import Settings
from orchestrator.service import Service
from orchestrator.state_store import SqliteStore

T = TypeVar("T")
KEY = "key-lists-" + "0" * 24
TICKS = 50  # the event loop's turns while the store is held (~1 s): it is let go after them
TICK_S = 0.02
HOLD_LIMIT_S = 60.0  # a loop that never ticks: the store is let go all the same, the test fails


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


@dataclass
class Held:
    """What happened while another thread held the store."""

    loop_ran: bool  # the event loop went on ticking while the work waited for the store
    waited: bool  # the work's answer came only once the store was let go


async def while_the_store_is_held(service: Service, work: Awaitable[T]) -> tuple[T, Held]:
    """What `work` gave, and whether the event loop went on meanwhile: another thread holds the
    store from just before the work starts until the loop has ticked TICKS times since (or
    HOLD_LIMIT_S, if it never does: a work that held the loop while it waited for the store).
    No clock decides: a busy machine only makes the ticks come later."""
    store = service.persistence.store
    assert isinstance(store, SqliteStore)
    held, let_go, hold_over = threading.Event(), threading.Event(), threading.Event()
    released: list[bool] = []  # whether the ticks let the store go (set once the hold ends)

    def hold() -> None:
        with store.database.lock:  # as a long write on another thread does
            held.set()
            released.append(let_go.wait(HOLD_LIMIT_S))
            hold_over.set()  # still held: a work that waited for the store answers after this

    holder = threading.Thread(target=hold)
    holder.start()
    await asyncio.to_thread(held.wait)

    async def tick() -> None:
        for _ in range(TICKS):
            await asyncio.sleep(TICK_S)
        let_go.set()

    working = asyncio.ensure_future(work)
    ticking = asyncio.ensure_future(tick())
    try:
        result = await working
        answered_while_held = not hold_over.is_set()
    finally:
        let_go.set()
        await ticking
        await asyncio.to_thread(holder.join)
    return result, Held(loop_ran=released == [True], waited=not answered_while_held)


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
                answer, held = await while_the_store_is_held(service, client.get(page))
                assert answer.status_code == 200, (page, answer.text)
                assert sid in answer.text, page
                assert held.waited, f"{page} did not read the store: the test shows nothing"
                assert held.loop_ran, f"{page}: the event loop stood still while it waited"
        finally:
            await client.delete(f"/v1/sessions/{sid}")
