"""Commands, background processes and terminals of a session with host tools, as origins of
tool calls (call_origins.py): each is given its token in its environment, and its calls (and
those of what it starts) may run while it runs, shown to a human with its command line."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from code_interpreter_wire.processes import ProcessRequest
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.call_origins import OriginKind, RunningCode
from sandbox.backends.base import Sandbox
from sandbox.processes.handle import ProcessHandle


def _tagged(request: ProcessRequest, entry: RunningCode) -> ProcessRequest:
    return request.model_copy(update={"env": entry.environment(request.env)})


def _shown(request: ProcessRequest, line: str) -> tuple[OriginKind, str]:
    if request.terminal is not None:
        return "terminal", f"a terminal ({line}): what is typed in it is in the audit log"
    return "process", line


@asynccontextmanager
async def command_origin(
    approvals: Approvals, session_id: str, request: ProcessRequest, line: str, *, tools: bool
) -> AsyncIterator[ProcessRequest]:
    """The request to run, an origin while the block runs (`tools`: the session has some)."""
    if not tools:
        yield request
        return
    async with approvals.running(
        session_id, line, request.timeout_s, kind="command", shared=True
    ) as entry:
        yield _tagged(request, entry)


async def start_origin(
    approvals: Approvals,
    session_id: str,
    sandbox: Sandbox,
    request: ProcessRequest,
    line: str,
    *,
    tools: bool,
) -> ProcessHandle:
    """Start a background process (or a terminal), an origin until it ends."""
    if not tools:
        return await sandbox.start_process(request)
    kind, code = _shown(request, line)
    entry = await approvals.origins.open(session_id, kind, code, request.timeout_s, shared=True)
    try:
        process = await sandbox.start_process(_tagged(request, entry))
    except BaseException:
        approvals.origins.end(entry)
        raise
    approvals.origins.end_after(entry, process.wait())
    return process
