"""Leases in the Redis every replica shares (cluster mode): one replica at a time changes a
session's state, or saves for one key against its quota. redis-py's lock, renewed while held,
so a replica that dies holding one frees it within `LEASE_S`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from orchestrator.session_error import SessionError

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)

LEASE_S = 30.0  # a lease not renewed for this long (its replica died) is free again
WAIT_S = 660.0  # the longest a call waits for another replica's change (a save takes <= 600 s)
_RETRY_S = 1.0  # a renewal that failed is tried again this soon


class LeaseBusy(SessionError):
    """Another replica held the lease the whole time this call could wait."""

    status = 409


@contextlib.asynccontextmanager
async def lease(
    shared: RedisConnection, name: str, what: str, wait_s: float = WAIT_S
) -> AsyncIterator[None]:
    """Hold the lease `name` (renewed every third of `LEASE_S`); LeaseBusy saying `what` waits
    past `wait_s`, StoreUnavailable if the store fails."""
    held = shared.client.lock(
        shared.key("lease", name), timeout=LEASE_S, blocking_timeout=wait_s, thread_local=False
    )
    with shared.errors():
        taken = await held.acquire()
    if not taken:
        raise LeaseBusy(f"another replica has been {what} for {wait_s:g} s; try again later")

    async def renew() -> None:
        from redis.exceptions import LockNotOwnedError  # the [cluster] extra's: here only

        wait = LEASE_S / 3
        while True:
            await asyncio.sleep(wait)
            try:
                await held.reacquire()
                wait = LEASE_S / 3
            except LockNotOwnedError:  # it lapsed and another replica holds it: said, loudly
                log.error(
                    "the lease %s lapsed (the store was unreachable for %g s) and another "
                    "replica took it: the change under it may race that replica's",
                    name,
                    LEASE_S,
                )
                return
            except Exception as exc:  # a blip of the store: tried again soon, said once
                if wait != _RETRY_S:
                    log.warning("the lease %s was not renewed (trying again): %s", name, exc)
                wait = _RETRY_S

    renewing = asyncio.ensure_future(renew())
    try:
        yield
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        with contextlib.suppress(Exception):  # expired already: nothing to give back
            await held.release()
