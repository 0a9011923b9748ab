"""Runs: code in a session's kernels, commands, and processes beside the kernel (background
commands, terminals). Each is checked by admission, marks the session active, is counted on
/metrics and kept in the audit trail, here once for every front door."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest, TerminalSize
from code_interpreter_wire.rest import ExecutionRecord, SessionInfo
from code_interpreter_wire.results import EventSink, OutputEvent
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.process_origins import command_origin, start_origin
from orchestrator.metrics import METRICS
from orchestrator.outputs import KeptOutputs
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail, command_outcome
from orchestrator.service_parts.channels import Channels
from orchestrator.service_parts.views import Views
from orchestrator.sessions import Session
from orchestrator.streaming import Dropped, Finished, Keepalive, follow
from sandbox.processes.managed import ProcessEvent


class Runs:
    def __init__(
        self,
        admission: Admission,
        approvals: Approvals,
        channels: Channels,
        trail: AuditTrail,
        outputs: KeptOutputs,
        views: Views,
    ) -> None:
        self._admission = admission
        self._approvals = approvals
        self._channels = channels
        self._trail = trail
        self._outputs = outputs
        self._views = views

    # --- code
    async def execute(
        self,
        session: Session,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        language: str | None = None,
    ) -> ExecutionRecord:
        """Run code in a session's kernel of `language` (None: Python), count it, keep its
        output, and return it with its ids. An unknown language is `UnknownLanguage`, one the
        session's sandbox lacks `LanguageUnavailable`: both name the languages there are."""
        name = self._admission.check_language(session, language)
        async with session.activity():
            waited = await self._admission.approval_gate(session, "execution", "execution", code)
            try:
                limit = self._admission.execution_timeout(timeout_s)
                tools = self._channels.serves(session.id)  # its calls name it: `origin` in env
                async with self._approvals.running(
                    session.id, code, limit, shared=tools
                ) as running:
                    execution = await session.sandbox.execute(
                        code,
                        timeout_s=limit,
                        env=running.environment(env) if tools else env,
                        cwd=cwd,
                        on_event=on_event,
                        language=name,
                    )
            except BaseException as exc:  # it broke, or its caller left: recorded all the same
                self._trail.execution(session, code, name, None, None, exc)
                raise
        session.executions += 1
        if session.notice is not None:  # what a resume or a fork brought back, said once
            told = f"{session.notice}. {execution.notice}" if execution.notice else session.notice
            execution = execution.model_copy(
                update={"notice": told, "state_lost": execution.state_lost or session.state_lost}
            )
            session.notice, session.state_lost = None, False
        # `name` is canonical (one of LANGUAGES): the label's values stay bounded.
        METRICS.executions.labels(session.backend, execution.status, name).inc()
        METRICS.execution_seconds.labels(session.backend).observe(execution.duration_s)
        execution_id = await self._outputs.save(session.id, execution)
        self._trail.execution(session, code, name, execution, execution_id)
        return ExecutionRecord(
            **dict(execution),
            session_id=session.id,
            execution_id=execution_id,
            language=name,
            approvals=waited + running.outcomes,
        )

    def stream(
        self,
        session: Session,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        language: str | None = None,
    ) -> AsyncGenerator[OutputEvent | Dropped | Keepalive | Finished[ExecutionRecord]]:
        """`execute`, followed as it happens: its events, keepalives while it is quiet, then
        `Finished` with the record. Closing the generator early interrupts the code."""
        self._admission.check_language(session, language)  # refused now, not once started

        def start(sink: EventSink) -> Awaitable[ExecutionRecord]:
            return self.execute(
                session,
                code,
                timeout_s=timeout_s,
                env=env,
                cwd=cwd,
                on_event=sink,
                language=language,
            )

        return follow(start)

    async def interrupt(self, session: Session) -> bool:
        """Stop the running execution, if any; whether one was stopped."""
        async with session.reach():
            return await session.sandbox.interrupt()

    async def restart(self, session: Session, language: str | None = None) -> SessionInfo:
        """A fresh kernel of `language` (None: every kernel started) in the same sandbox:
        variables go, files stay."""
        name = None if language is None else self._admission.check_language(session, language)
        async with session.activity():
            await session.sandbox.restart(name)
        return self._views.info(session)

    # --- processes beside the kernel (commands, background processes, terminals)
    async def run_command(
        self,
        session: Session,
        request: ProcessRequest,
        *,
        approvals: list[ApprovalOutcome] | None = None,
        file_transfer: bool = False,
    ) -> CommandResult:
        """Run a command to its end (a caller that leaves kills it); its output within caps.
        `approvals`: given, it gets the approval the command waited for (if its key's policy
        made it wait). `file_transfer`: a front's own file operation done by a command (E2B's
        files outside the workspace), not the key's command: no `commands` rule, no approval."""
        if not file_transfer:
            self._admission.check_commands(session.owner, session.id)
        line = self._trail.command_line(request)
        async with session.activity():
            waited = (
                []
                if file_transfer
                else await self._admission.approval_gate(session, "command", line, None)
            )
            if approvals is not None:
                approvals += waited
            tools = self._channels.serves(session.id) and not file_transfer
            try:
                async with command_origin(
                    self._approvals,
                    session.id,
                    self._admission.process_request(request),
                    line,
                    tools=tools,
                ) as tagged:  # an origin of tool calls while it runs
                    result = await session.sandbox.run_command(tagged)
            except BaseException as exc:  # it could not run, or its caller left
                self._trail.command(session, request, None, exc, file_transfer=file_transfer)
                raise
        METRICS.commands.labels(session.backend, command_outcome(result)).inc()
        self._trail.command(session, request, result, file_transfer=file_transfer)
        return result

    async def start_process(
        self, session: Session, request: ProcessRequest, *, file_transfer: bool = False
    ) -> ProcessInfo:
        """Start a process that runs on after this call (a background command or a terminal).
        `file_transfer`: as `run_command`'s."""
        line = self._trail.command_line(request)
        if not file_transfer:
            self._admission.check_commands(session.owner, session.id)
            async with session.activity():  # while it waits for a human, if it must
                await self._admission.approval_gate(session, "command", line, None)
        async with session.reach():
            process = await start_origin(  # an origin of tool calls until it ends
                self._approvals,
                session.id,
                session.sandbox,
                self._admission.process_request(request),
                line,
                tools=self._channels.serves(session.id) and not file_transfer,
            )
        METRICS.processes_started.labels(session.backend).inc()
        info = process.info()
        self._trail.process_started(session, request, info, file_transfer=file_transfer)
        return info

    async def list_processes(
        self, session: Session, *, include_ended: bool = False
    ) -> list[ProcessInfo]:
        async with session.reach():
            return await session.sandbox.processes(include_ended=include_ended)

    async def process_info(self, session: Session, pid: int) -> ProcessInfo:
        async with session.reach():
            return (await session.sandbox.get_process(pid)).info()

    async def process_events(
        self, session: Session, pid: int, *, replay: bool = False
    ) -> AsyncIterator[ProcessEvent]:
        """A process's output from now on (`replay`: the most recent kept first), then its end;
        a wrong pid raises here, before the stream starts."""
        async with session.reach():
            process = await session.sandbox.get_process(pid)
        return session.reaching(process.events(replay=replay))

    async def wait_process(self, session: Session, pid: int) -> CommandResult:
        async with session.activity():
            return await (await session.sandbox.get_process(pid)).wait()

    async def send_input(
        self, session: Session, pid: int, data: bytes, *, file_transfer: bool = False
    ) -> None:
        """Write to a process's stdin (or its terminal): recorded in the audit log, unless it
        is a front's own file transfer (the file's upload is recorded as one)."""
        async with session.reach():
            process = await session.sandbox.get_process(pid)
            await process.write_stdin(data)
        if not file_transfer:
            terminal = process.info().terminal
            self._trail.input.typed(session.id, session.owner, pid, data, terminal=terminal)

    async def close_input(self, session: Session, pid: int) -> None:
        async with session.reach():
            await (await session.sandbox.get_process(pid)).close_stdin()
        self._trail.input.closed(session.id, pid)

    async def signal_process(self, session: Session, pid: int, signum: int) -> None:
        """Send a signal to a process and everything it started (SIGKILL: `kill`)."""
        async with session.reach():
            await (await session.sandbox.get_process(pid)).signal(signum)

    async def resize_terminal(self, session: Session, pid: int, size: TerminalSize) -> None:
        async with session.reach():
            await (await session.sandbox.get_process(pid)).resize(size)
