"""Egress records of sessions whose proxy runs beside their sandbox on another machine: each
replica serving such a session takes the records its proxy kept (a long poll, node_egress.py)
and hands each to the service's log, metrics and audit, as the proxy's hook does on one machine.

Several replicas may poll one session: the outbox hands each record to one of them, so each
connection is logged and audited once. A loop stops when the session ends here (`stop`) or its
sandbox is lost or closed; any other failure (the cluster out of reach for now, its proxy not
opened yet by the replica that makes it) is retried after a pause that doubles up to
`RETRY_MAX_S`. What it takes is bounded by the outbox's batch size.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from code_interpreter_wire.errors import SandboxClosed, SandboxLost
from orchestrator.cluster.session_loops import RETRY_FIRST_S, RETRY_MAX_S, SessionLoops
from orchestrator.cluster.shared import RelayedEgress
from sandbox.egress import EgressRecord

log = logging.getLogger(__name__)
POLL_S = 10.0  # each long poll waits at most this long for a record


class EgressRelays(SessionLoops):
    """The record loops this replica runs, by session id, each with the sandbox it polls."""

    async def start(
        self,
        session_id: str,
        sandbox: RelayedEgress,
        on_record: Callable[[EgressRecord], None],
    ) -> None:
        """Take the session's records, each to `on_record` (which must not block or raise);
        again on the same sandbox: nothing changes (see SessionLoops)."""
        await self.run(session_id, sandbox, lambda: _relay(session_id, sandbox, on_record))


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
        except Exception as exc:  # out of reach for now: the session stays, so does this
            log.warning(
                "egress of session %s: polling failed, again in %g s: %r", session_id, pause, exc
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
