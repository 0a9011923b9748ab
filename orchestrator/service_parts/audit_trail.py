"""The audit trail (docs/governance.md): one method per kind of event the service records, so
what an event carries is decided here once, and every part records through this."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest
from code_interpreter_wire.results import Execution
from orchestrator.governance import audit_kinds as audited
from orchestrator.governance.audit import AuditLog, command_line, end_reason
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.input_audit import InputAudit
from orchestrator.governance.policy import Principal
from orchestrator.governance.stores.audit_store import AuditEvent, AuditPage, AuditQuery
from orchestrator.sessions import Session
from orchestrator.settings_sections import AuditSection
from sandbox.egress import EgressRecord


def command_outcome(result: CommandResult) -> str:
    """A command's status, as the audit log and the metrics say it."""
    if result.timed_out:
        return "timeout"
    return "ok" if result.exit_code == 0 else "error"


class AuditTrail:
    """What ran, who asked, when: the log (written once the store is open) and what is typed
    into terminals and processes' stdin."""

    def __init__(self, settings: AuditSection, principal_of: Callable[[str], Principal]) -> None:
        """`principal_of(owner)`: who an owner id is (its name goes with each event)."""
        self._principal_of = principal_of
        self._max_code_chars = settings.audit_max_code_chars
        self.log = AuditLog(settings, name_of=lambda owner: principal_of(owner).name)
        self.input = InputAudit(
            self.log,
            record_bytes=settings.audit_input_record_bytes,
            records_per_minute=settings.audit_input_records_per_minute,
        )

    def viewer(self, owner: str) -> Principal:
        """Who reads the audit log: an admin reads every key's events, others their own."""
        return self._principal_of(owner)

    async def close(self) -> None:
        self.input.close()  # input typed and not yet written, into the log below
        await self.log.close()

    # --- reading the log: what a front shows a viewer
    @property
    def enabled(self) -> bool:
        return self.log.enabled

    async def query(self, viewer: Principal, query: AuditQuery) -> AuditPage:
        """A page of the events `viewer` may see (an admin's: everyone's), newest first."""
        return await self.log.query(viewer, query)

    async def export(
        self, viewer: Principal, query: AuditQuery
    ) -> AsyncGenerator[AuditEvent, None]:
        """Every event `query` selects that `viewer` may see, a page at a time."""
        return await self.log.export(viewer, query)

    def command_line(self, request: ProcessRequest) -> str:
        return command_line(request.argv, request.command, self._max_code_chars)

    # --- sessions
    def created(self, session: Session, tools: list[str], snapshot_id: str | None) -> None:
        spec = session.sandbox.spec
        self.log.record(
            audited.SESSION_CREATED,
            owner=session.owner,
            session_id=session.id,
            details={
                "backend": session.backend,
                "image": spec.image,
                "runtime": spec.runtime,
                "network": spec.network.mode,
                "tools": sorted(tools),
                "snapshot_id": snapshot_id,
                "from_pool": session.from_pool,
            },
        )

    def ended(self, session_id: str, owner: str, why: str) -> None:
        self.log.record(
            audited.SESSION_ENDED,
            owner=owner,
            session_id=session_id,
            status=end_reason(why),
            details={"reason": end_reason(why), "why": why},
        )

    def paused(self, session: Session, saved_bytes: int | None, suspended: bool) -> None:
        self.log.record(
            audited.SESSION_PAUSED,
            owner=session.owner,
            session_id=session.id,
            details={"saved_bytes": saved_bytes, "suspended": suspended},
        )

    def resumed(self, session_id: str, owner: str) -> None:
        self.log.record(audited.SESSION_RESUMED, owner=owner, session_id=session_id)

    def policy_denied(self, owner: str, session_id: str | None, exc: PolicyDenied) -> None:
        self.log.record(
            audited.POLICY_DENIED,
            owner=owner,
            session_id=session_id,
            status="denied",
            details={"rule": exc.rule, "message": str(exc)},
        )

    # --- what ran
    def execution(
        self,
        session: Session,
        code: str,
        language: str,
        execution: Execution | None,
        execution_id: str | None,
        failure: BaseException | None = None,
    ) -> None:
        details: dict[str, object] = {
            "execution_id": execution_id,
            "language": language,
            "code": code,
        }
        if execution is not None:
            details |= {
                "stdout_chars": len(execution.stdout) + execution.stdout_dropped,
                "stderr_chars": len(execution.stderr) + execution.stderr_dropped,
                "results": len(execution.results),
                "images": sum(
                    1 for r in execution.results for i in (r.png, r.jpeg, r.svg) if i is not None
                ),
                "error": execution.error.name if execution.error is not None else None,
            }
        else:
            details["failure"] = f"{type(failure).__name__}: {failure}"
        self.log.record(
            audited.EXECUTION,
            owner=session.owner,
            session_id=session.id,
            status=str(execution.status) if execution is not None else "failed",
            duration_s=execution.duration_s if execution is not None else None,
            details=details,
        )

    def command(
        self,
        session: Session,
        request: ProcessRequest,
        result: CommandResult | None,
        failure: BaseException | None = None,
        *,
        file_transfer: bool = False,
    ) -> None:
        details: dict[str, object] = {"command": self.command_line(request)}
        if request.user is not None:  # run as the machine's root (a gVisor session)
            details["user"] = request.user
        if file_transfer:  # a front's file operation, shown as one (not as the key's command)
            details["file_transfer"] = True
        if result is not None:
            details |= {
                "pid": result.pid,
                "exit_code": result.exit_code,
                "signal": result.signal,
                "stdout_chars": len(result.stdout) + result.stdout_dropped,
                "stderr_chars": len(result.stderr) + result.stderr_dropped,
            }
        else:
            details["failure"] = f"{type(failure).__name__}: {failure}"
        self.log.record(
            audited.COMMAND,
            owner=session.owner,
            session_id=session.id,
            status=command_outcome(result) if result is not None else "failed",
            duration_s=result.duration_s if result is not None else None,
            details=details,
        )

    def process_started(
        self, session: Session, request: ProcessRequest, info: ProcessInfo, *, file_transfer: bool
    ) -> None:
        self.log.record(
            audited.PROCESS_STARTED,
            owner=session.owner,
            session_id=session.id,
            details={
                "pid": info.pid,
                "command": self.command_line(request),
                "terminal": request.terminal is not None,
                "tag": request.tag,
            }
            | ({"user": request.user} if request.user is not None else {})
            | ({"file_transfer": True} if file_transfer else {}),
        )

    def file(self, kind: str, session: Session, path: str, size: int | None = None) -> None:
        self.log.record(
            kind,
            owner=session.owner,
            session_id=session.id,
            details={"path": path, "bytes": size},
        )

    def volume(
        self, kind: str, owner: str, volume_id: str, session_id: str | None = None, **details: Any
    ) -> None:
        """A volume made, deleted, mounted, or a file of it changed from outside."""
        self.log.record(
            kind, owner=owner, session_id=session_id, details={"volume_id": volume_id, **details}
        )

    def egress_connection(self, session: Session, entry: EgressRecord) -> None:
        self.log.record(
            audited.EGRESS_CONNECTION,
            owner=session.owner,
            session_id=session.id,
            status="allowed" if entry.allowed else "refused",
            duration_s=entry.duration_s,
            details={
                "method": entry.method,
                "host": entry.host,
                "port": entry.port,
                "address": entry.address,
                "reason": entry.reason,
                "bytes_up": entry.bytes_up,
                "bytes_down": entry.bytes_down,
                # When it ended: a record relayed from a node is taken later (egress_relay.py);
                # the event's own time stays when it was written, as every listing expects.
                "ended_at": round(entry.time + entry.duration_s, 3),
            },
        )

    def secret_event(
        self,
        kind: str,
        owner: str,
        session_id: str | None,
        status: str,
        details: dict[str, Any],
    ) -> None:
        """A secret stored, deleted or used (orchestrator/vault/): names, never values."""
        self.log.record(kind, owner=owner, session_id=session_id, status=status, details=details)

    def port_connection(
        self,
        session: Session,
        *,
        port: int,
        caller: str,
        client: str | None,
        status: str,
        duration_s: float,
        bytes_in: int,
        bytes_out: int,
        reason: str,
        unaudited_before: int = 0,
    ) -> None:
        """One connection to a session's port as it ended (or its refusal): `bytes_in` went
        into the sandbox, `bytes_out` came out of it; `unaudited_before`: connections since the
        last event that the rate of others' connections left out (service_parts/ports.py)."""
        details: dict[str, object] = {
            "port": port,
            "caller": caller,
            "client": client,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "reason": reason,
        }
        if unaudited_before:
            details["unaudited_before"] = unaudited_before
        self.log.record(
            audited.PORT_CONNECTION,
            owner=session.owner,
            session_id=session.id,
            status=status,
            duration_s=duration_s,
            details=details,
        )
