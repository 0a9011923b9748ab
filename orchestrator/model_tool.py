"""The model tool's front door: one call of `code_interpreter` (code) or `run_command` (a shell
command line), as a model makes it through any front that offers the tools (the REST invoke
routes, MCP, an agent in-process). It finds or starts the session, runs the call through the
service, and renders the answer for a model: whatever the model can act on (a wrong id, a full
quota, a broken sandbox, a language there is not) comes back as an error output telling it
what to do, never as an exception."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from code_interpreter_wire.errors import LanguageUnavailable, SandboxError, UnknownLanguage
from code_interpreter_wire.languages import canonical_language
from code_interpreter_wire.rest import CreateSessionRequest, ExecutionRecord
from code_interpreter_wire.tool_output import RenderedOutput, render, render_command
from orchestrator.governance.errors import ApprovalDenied, PolicyDenied
from orchestrator.service import Service
from orchestrator.service_parts.audit_trail import command_outcome
from orchestrator.sessions import Session, SessionError

POLICY_DENIED = "policy_denied"  # a tool call's status when its key's policy refused it
APPROVAL_DENIED = "approval_denied"  # ... when a human denied it (or no one answered in time)
HINT_NEW_SESSION = " Omit session_id to start a new session."
HINT_NEW_SESSION_STATE = " Omit session_id to start a new session (earlier variables will be gone)."

# Where a rendered tool output points: (the full output's URL, each artifact's URL by id).
OutputLinks = Callable[[str, ExecutionRecord], tuple[str | None, dict[str, str]]]


@dataclass
class ToolOutcome:
    """A tool call's result: the session it ran in, the record (None when the call was
    refused, and for `run_command`, whose commands are not kept), and the output a model
    reads."""

    session_id: str | None
    record: ExecutionRecord | None
    rendered: RenderedOutput
    status: str  # an ExecutionStatus, or why the call was refused

    @staticmethod
    def refused(message: str, status: str, session_id: str | None = None) -> ToolOutcome:
        return ToolOutcome(session_id, None, RenderedOutput(f"[error] {message}", [], True), status)


class ModelTool:
    """The tools' flow over one service."""

    def __init__(self, service: Service) -> None:
        self._service = service

    async def start_session(self, owner: str, *, idle_timeout_s: float | None = None) -> Session:
        """A session the tool starts by itself: given the default host tools its key's policy
        allows (the others are left out, not refused: the model asked for none of them)."""
        service = self._service
        request = CreateSessionRequest(tools=service.channels.default_tools())
        return await service.lifecycle.create(
            owner, request, idle_timeout_s=idle_timeout_s, tools_within_policy=True
        )

    async def _session(
        self, owner: str, session_id: str | None, session: Session | None, hint: str
    ) -> Session | ToolOutcome:
        """The session a tool call runs in: the one given, the one named, or a new one; or the
        refusal a model reads (with `hint` when it named one)."""
        if session is not None:
            return session
        try:
            if session_id is not None:
                return await self._service.lifecycle.get(session_id, owner)
            return await self.start_session(owner)
        except PolicyDenied as exc:  # the key's policy: the model reads the rule
            return ToolOutcome.refused(str(exc), POLICY_DENIED)
        except SessionError as exc:
            return ToolOutcome.refused(f"{exc}.{hint if session_id else ''}", "session_error")
        except SandboxError as exc:
            return ToolOutcome.refused(f"could not start a sandbox: {exc}", "session_error")

    async def invoke(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None = None,
        session: Session | None = None,
        links: OutputLinks | None = None,
        language: str | None = None,
    ) -> ToolOutcome:
        """One call of the `code_interpreter` tool: in the session named (`session_id`), or
        given (`session`), or a new one; then rendered for a model."""
        try:  # a name that is no language at all is refused before a session is made for it
            canonical_language(language)
        except UnknownLanguage as exc:
            return ToolOutcome.refused(f"{exc}. Omit language to run Python.", "invalid_call")
        found = await self._session(owner, session_id, session, HINT_NEW_SESSION_STATE)
        if isinstance(found, ToolOutcome):
            return found
        session = found
        try:
            record = await self._service.runs.execute(session, code, language=language)
        except LanguageUnavailable as exc:  # the model can pick another: said as its mistake
            return ToolOutcome.refused(str(exc), "invalid_call", session.id)
        except PolicyDenied as exc:  # the key's policy: the model reads the rule
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session.id)
        except ApprovalDenied as exc:  # a human said no (or no one answered): who, and why
            return ToolOutcome.refused(str(exc), APPROVAL_DENIED, session.id)
        except (SessionError, SandboxError) as exc:  # the session ended or broke during the run
            return ToolOutcome.refused(
                f"the session could not run the code: {exc}", "session_error", session.id
            )
        full_output_url, artifact_urls = (
            links(session.id, record) if links is not None else (None, {})
        )
        rendered = render(
            record,
            language=record.language,
            session_id=session.id,
            max_chars=self._service.views.tool_output_chars(),
            full_output_url=full_output_url,
            artifact_urls=artifact_urls,
            approvals=record.approvals,
        )
        return ToolOutcome(session.id, record, rendered, str(record.status))

    def check_shell(self) -> None:
        """Refuse the `run_command` tool unless the operator turned it on (ShellToolOff)."""
        self._service.admission.check_shell_tool()

    async def invoke_shell(
        self,
        owner: str,
        command: str,
        *,
        session_id: str | None = None,
        session: Session | None = None,
        timeout_s: float | None = None,
    ) -> ToolOutcome:
        """One call of the `run_command` tool: a shell command line in the session named, or
        given, or a new one (the same sessions as `code_interpreter`'s), within the tool's time
        limit; then rendered for a model. ShellToolOff when the tool is off."""
        admission = self._service.admission
        admission.check_shell_tool()
        try:  # before a session is made for it
            request = admission.shell_command(command, timeout_s)
        except ValidationError as exc:  # e.g. a NUL character, which no command line can hold
            problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            return ToolOutcome.refused(f"the command cannot be run: {problems}", "invalid_call")
        try:  # before a session is made for it
            admission.check_commands(owner, session.id if session is not None else session_id)
        except PolicyDenied as exc:
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session_id)
        found = await self._session(owner, session_id, session, HINT_NEW_SESSION)
        if isinstance(found, ToolOutcome):
            return found
        session = found
        waited: list[ApprovalOutcome] = []
        try:
            result = await self._service.runs.run_command(session, request, approvals=waited)
        except PolicyDenied as exc:
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session.id)
        except ApprovalDenied as exc:
            return ToolOutcome.refused(str(exc), APPROVAL_DENIED, session.id)
        except (SessionError, SandboxError) as exc:  # no processes here, too many, or it broke
            return ToolOutcome.refused(
                f"the session could not run the command: {exc}", "session_error", session.id
            )
        rendered = render_command(
            result,
            session_id=session.id,
            max_chars=self._service.views.tool_output_chars(),
            approvals=waited,
        )
        return ToolOutcome(session.id, None, rendered, command_outcome(result))
