"""Egress records of sessions whose proxy runs beside their sandbox on another machine: each
replica serving such a session takes the records its proxy kept (a long poll, node_egress.py)
and hands each to the service's log, metrics and audit, as the proxy's hook does on one machine.

Several replicas may poll one session: the outbox hands each record to one of them, so each
connection is logged and audited once. A loop stops when the session ends here (`stop`) or its
sandbox is lost or closed; any other failure (the cluster out of reach for now) is retried after
a pause that doubles up to `RETRY_MAX_S`. What it takes is bounded by the outbox's batch size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from code_interpreter_wire.errors import SandboxClosed, SandboxError, SandboxLost
from orchestrator.cluster.shared import RelayedEgress
from sandbox.egress import EgressRecord

log = logging.getLogger(__name__)
POLL_S = 10.0  # each long poll waits at most this long for a record
RETRY_FIRST_S = 0.5  # the pause after a failed poll; doubled after each failure in a row...
RETRY_MAX_S = 30.0  # ...up to this


class EgressRelays:
    """The record loops this replica runs, by session id."""

    def __init__(self) -> None:
        self._loops: dict[str, asyncio.Task[None]] = {}

    def start(
        self,
        session_id: str,
        sandbox: RelayedEgress,
        on_record: Callable[[EgressRecord], None],
    ) -> None:
        """Take the session's records, each to `on_record` (which must not block or raise);
        again while one runs: nothing changes."""
        running = self._loops.get(session_id)
        if running is None or running.done():
            task = asyncio.ensure_future(_relay(session_id, sandbox, on_record))
            self._loops[session_id] = task
            task.add_done_callback(lambda done: self._forget(session_id, done))

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self._loops.get(session_id) is task:
            del self._loops[session_id]

    async def stop(self, session_id: str) -> None:
        task = self._loops.pop(session_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def close(self) -> None:
        for session_id in list(self._loops):
            await self.stop(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._loops


async def _relay(
    session_id: str, sandbox: RelayedEgress, on_record: Callable[[EgressRecord], None]
) -> None:
    pause = RETRY_FIRST_S
    while True:
        try:
            batch = await sandbox.egress_records(POLL_S)
        except (SandboxLost, SandboxClosed) as exc:  # gone for good, or its proxy closed
            log.info("egress of session %s: the relay stopped: %s", session_id, exc)
            return
        except SandboxError as exc:  # out of reach for now: the session stays, so does this
            log.warning(
                "egress of session %s: polling failed, again in %g s: %s", session_id, pause, exc
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
            continue
        pause = RETRY_FIRST_S
        if batch.dropped:
            log.warning(
                "egress of session %s: %d connection records were dropped on its node (its "
                "outbox was full: no replica took them in time)",
                session_id,
                batch.dropped,
            )
        for record in batch.records:
            on_record(record)
