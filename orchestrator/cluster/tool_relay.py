"""Host tools of sessions whose sandbox is on another machine: each replica serving such a
session pulls its calls (a long poll on the sandbox's relay) and answers each with the session's
tools (`ToolChannel.answer`), as the socket listener does on one machine.

Several replicas may poll one session: the relay hands each call to one of them, so each call is
answered once. A loop answers at most the channel's calls-in-flight limit at once and polls for
more only when one is done: what a sandbox sends cannot grow this process's memory. It stops when
the session ends here (`stop`), or its sandbox is lost or closed (`SandboxLost`,
`SandboxClosed`); any other failure (the cluster out of reach for now, `BackendUnavailable`, as
while its head restarts) is retried after a pause that doubles up to `RETRY_MAX_S`, so a replica
never stops serving a live session's tools.

Every replica answers with its own tools of the names the session's record lists: every replica
must have the same host-tool settings (docs/cluster.md). The manifest (what the code reads of its
tools, and the limits its relay applies) is written once, by the replica that makes the session.
"""

from __future__ import annotations

import asyncio
import logging

from code_interpreter_wire.errors import SandboxClosed, SandboxError, SandboxLost
from orchestrator.cluster.session_loops import RETRY_FIRST_S, RETRY_MAX_S, SessionLoops
from orchestrator.cluster.shared import RelayedTools
from orchestrator.host_tools import ToolChannel

log = logging.getLogger(__name__)
POLL_S = 10.0  # each long poll waits at most this long for a call


class ToolRelays(SessionLoops):
    """The relay loops this replica runs, by session id, each with the sandbox it serves."""

    async def start(
        self,
        session_id: str,
        sandbox: RelayedTools,
        channel: ToolChannel,
        *,
        write_manifest: bool = True,
    ) -> None:
        """Write the session's tools where its code reads them (`write_manifest`: the replica
        that makes the session; one that attaches finds it written), then serve its calls
        (again on the same sandbox: nothing changes, see SessionLoops)."""
        if write_manifest:
            await sandbox.set_tool_manifest(channel.manifest())
        await self.run(session_id, sandbox, lambda: _relay(session_id, sandbox, channel))


async def _relay(session_id: str, sandbox: RelayedTools, channel: ToolChannel) -> None:
    limit = max(1, channel.limits.max_calls_in_flight)
    answering: set[asyncio.Task[None]] = set()
    pause = RETRY_FIRST_S
    try:
        while True:
            if len(answering) >= limit:  # no more calls taken than can be answered at once
                await asyncio.wait(answering, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                calls = await sandbox.tool_calls(POLL_S)
            except (SandboxLost, SandboxClosed) as exc:  # gone for good: the session ends
                log.info("host tools of session %s: the relay stopped: %s", session_id, exc)
                return
            except SandboxError as exc:  # out of reach for now: the session stays, so does this
                log.warning(
                    "host tools of session %s: polling failed, again in %g s: %s",
                    session_id,
                    pause,
                    exc,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = RETRY_FIRST_S
            for key, body in calls:
                task = asyncio.ensure_future(_answer(session_id, sandbox, channel, key, body))
                answering.add(task)
                task.add_done_callback(answering.discard)
    finally:
        for task in answering:
            task.cancel()


async def _answer(
    session_id: str, sandbox: RelayedTools, channel: ToolChannel, key: str, body: bytes
) -> None:
    reply = await channel.answer(body)
    try:
        await sandbox.answer_tool_call(key, reply)
    except SandboxError as exc:  # timed out there meanwhile, or the sandbox is gone
        log.info("host tools of session %s: an answer was not delivered: %s", session_id, exc)
