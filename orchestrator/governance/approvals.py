"""Human approval of risky calls: a host tool marked `requires_approval` (or named by its key's
policy's `approval_tools`), and, where a key's policy says so, whole executions and commands.

`request` publishes an approval request (in the state store, so any replica can list and answer
it), tells the operator's webhook (whose answer may decide it), offers it to the responder
registered for the session (an MCP client that elicits its user's answer), and waits: for a
local answer, and by reading the store every `POLL_S` (another replica may have answered). No
answer within `approval_timeout_s` is a denial, decided by "timeout". One answer wins: the
store decides a request only while it is pending.

Bounded: requests waiting are capped per session and on this replica (one more is refused, never
queued); what a request keeps of the code, the arguments and a reason is capped.

A wait never outlives what waits: a tool call's wait ends before the time limit of the execution
(or command, process) that made it (the code reads ToolDenied, it is not interrupted mid-wait),
and is abandoned when that one ends first (interrupted, timed out, or finished without awaiting
the call); every wait of a session ends when the session does. An abandoned request is
`expired`, decided by "abandoned": no answer can run it any more. Which one made a call is what
the call frame names (call_origins.py), never merely what runs now. One another replica runs
(found in the shared store) bounds the wait by the time limit kept there, and is read again at
each poll: its end abandons the wait as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from code_interpreter_wire.approval_outcome import ABANDONED, TIMEOUT, ApprovalOutcome
from orchestrator.governance import audit_kinds
from orchestrator.governance.approval_errors import (
    ApprovalAlreadyDecided,
    ApprovalForbidden,
    ApprovalNotFound,
    ApprovalsFull,
)
from orchestrator.governance.call_origins import (
    CallOrigins,
    OriginKind,
    RunningCode,
    SharedOrigins,
    word_for,
)
from orchestrator.governance.errors import ApprovalDenied
from orchestrator.governance.policy import Principal
from orchestrator.governance.stores.approval_store import (
    ApprovalKind,
    ApprovalRecord,
    ApprovalState,
    ApprovalStore,
)
from orchestrator.governance.webhook import ApprovalWebhook
from orchestrator.settings_sections import ApprovalSection

if TYPE_CHECKING:
    from orchestrator.governance.audit import AuditLog

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting request reads the store (another replica may answer)
LATE_S = 5.0  # a request still pending this long past its expiry was left by a dead waiter
MAX_CODE_CHARS = 64 << 10
MAX_ARGUMENTS_CHARS = 16 << 10
MAX_SUBJECT_CHARS = 4096
MAX_REASON_CHARS = 1000
MAX_NOTED = 100  # approval outcomes one execution reports
MCP = "mcp"  # decided_by of an answer elicited from an MCP client's user
WEBHOOK = "webhook"
EXECUTION_ENDED = (
    "the execution that made the call ended before an answer (it was interrupted, timed out, "
    "or did not wait for the call)"
)
SESSION_ENDED = "the session ended before an answer"

# What an MCP connection's user answered: (approve, reason), or None when it cannot ask.
Responder = Callable[[ApprovalRecord], Awaitable[tuple[bool, str | None] | None]]


def canonical_arguments(arguments: Any) -> bytes:
    """A tool call's arguments as canonical JSON: what their digest is taken of."""
    return json.dumps(
        arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    ).encode()


def arguments_digest(arguments: Any) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of the canonical arguments."""
    data = canonical_arguments(arguments)
    return hashlib.sha256(data).hexdigest(), len(data)


def _capped(text: str | None, most: int) -> str | None:
    if text is None or len(text) <= most:
        return text
    return f"{text[:most]}\n[... {len(text) - most} more characters]"


def _kept_arguments(arguments: Any) -> Any:
    """The arguments as the request keeps them: whole when small, else a preview and a digest."""
    data = canonical_arguments(arguments)
    if len(data) <= MAX_ARGUMENTS_CHARS:
        return arguments
    return {
        "truncated": True,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "preview": data[:MAX_ARGUMENTS_CHARS].decode(errors="replace"),
    }


class Approvals:
    def __init__(
        self,
        settings: ApprovalSection,
        store_of: Callable[[], ApprovalStore],
        *,
        principal_of: Callable[[str], Principal],
        audit: AuditLog | None = None,
        origins_of: Callable[[], SharedOrigins | None] = lambda: None,
    ) -> None:
        """`store_of()`: the state store's approvals (any replica's answers land there; asked
        at each use: the service opens its store when it starts); `principal_of(owner)`: who a
        session's key is (its name, its policy); `origins_of()`: the shared store's running
        origins of tool calls, or None (call_origins.py)."""
        self.timeout_s = settings.approval_timeout_s
        self._max_per_session = settings.approval_max_pending_per_session
        self._max_total = settings.approval_max_pending_total
        self._store_of = store_of
        self._principal_of = principal_of
        self._audit = audit
        self._webhook = (
            ApprovalWebhook(
                settings.approval_webhook_url,
                settings.approval_webhook_secret,
                settings.approval_webhook_timeout_s,
            )
            if settings.approval_webhook_url
            else None
        )
        self._answered: dict[str, asyncio.Event] = {}  # request id -> set once decided
        self._waiting_in: dict[str, set[str]] = {}  # session id -> its requests waiting
        self._abandoned: dict[str, str] = {}  # request id -> why its wait is to end now
        self._responders: dict[str, list[Responder]] = {}  # session id -> latest last
        # What runs in each session and may call tools: its waits are abandoned when it ends.
        self.origins = CallOrigins(origins_of, on_end=self._origin_ended)
        self._shared_origins = origins_of  # not None: a cluster's store, replicas beside this

    async def close(self) -> None:
        await self.origins.close()
        if self._webhook is not None:
            await self._webhook.aclose()

    @property
    def waiting(self) -> int:
        """Requests waiting on this replica."""
        return len(self._answered)

    # --- what a session is doing: its code, and who can answer for it ---------------------

    @contextlib.asynccontextmanager
    async def running(
        self,
        session_id: str,
        code: str,
        timeout_s: float | None = None,
        *,
        kind: OriginKind = "execution",
        shared: bool = False,
    ) -> AsyncIterator[RunningCode]:
        """While an execution (or a command) runs: the tool calls that name it (its
        `origin`) may run, their requests show its code, their waits end before its time limit
        (`timeout_s`), they are abandoned when it ends, and their outcomes are gathered for its
        output. `shared`: its session has host tools (another replica may take their calls)."""
        entry = await self.origins.open(session_id, kind, code, timeout_s, shared=shared)
        try:
            yield entry
        finally:
            self.origins.end(entry)

    def _origin_ended(self, entry: RunningCode) -> None:
        if entry.kind == "execution":
            why = EXECUTION_ENDED
        else:
            why = EXECUTION_ENDED.replace("execution", word_for(entry.kind), 1)
        self._abandon(entry.waiting, why)

    def abandon_session(self, session_id: str) -> None:
        """The session ended: every wait of its here ends now (as denials no answer can
        change), so its callers go at once and nothing runs in a sandbox that is gone; and
        nothing of it calls a tool any more."""
        self._abandon(self._waiting_in.get(session_id, set()), SESSION_ENDED)
        self.origins.forget_session(session_id)

    async def abandon_session_elsewhere(self, session_id: str) -> None:
        """The session ended (cluster mode): the waits other replicas hold for it end too. Each
        pending request of it in the shared store is decided as abandoned, which their waits
        read within POLL_S instead of waiting out their time. On one machine every wait is
        here (abandon_session): nothing to do. A request that fails to be decided (the store
        down) ends at its own time limit."""
        if self._shared_origins() is None:
            return
        pending = await self._store_of().approvals(
            state="pending", session_id=session_id, limit=self._max_total
        )
        for record in pending:
            try:
                await self._decide(record, "expired", ABANDONED, SESSION_ENDED)
            except Exception:
                log.warning(
                    "approval request %s of ended session %s could not be ended in the store; "
                    "it ends at its time limit",
                    record.id,
                    session_id,
                    exc_info=True,
                )

    def _abandon(self, request_ids: set[str], why: str) -> None:
        for request_id in list(request_ids):
            event = self._answered.get(request_id)
            if event is not None and request_id not in self._abandoned:
                self._abandoned[request_id] = why
                event.set()

    @staticmethod
    def note(entry: RunningCode, outcome: ApprovalOutcome) -> None:
        """Keep an outcome for the output of the execution whose call it was."""
        if len(entry.outcomes) < MAX_NOTED:
            entry.outcomes.append(outcome)
        else:
            entry.more += 1

    @contextlib.contextmanager
    def responder(self, session_id: str, respond: Responder) -> Iterator[None]:
        """While a front's call runs in the session (an MCP tool call): requests of the session
        are offered to `respond` too (the latest registered answers)."""
        stack = self._responders.setdefault(session_id, [])
        stack.append(respond)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                stack.remove(respond)
            if not stack:
                self._responders.pop(session_id, None)

    # --- asking -----------------------------------------------------------------------------

    async def request(
        self,
        kind: ApprovalKind,
        *,
        session_id: str,
        owner: str,
        subject: str,
        arguments: Any = None,
        code: str | None = None,
        made_by: RunningCode | None = None,
        waits_end_at: float | None = None,
        origin_runs: Callable[[], Awaitable[bool]] | None = None,
    ) -> ApprovalOutcome:
        """Publish a request and wait for its decision (at most `approval_timeout_s`). Raises
        ApprovalsFull, and nothing is published, when too many wait already. `made_by`: the
        execution (or process) a tool call came from, running here: the wait ends before its
        time limit and is abandoned when it ends. For one another replica runs: `waits_end_at`
        (time.time()) ends the wait, and the wait is abandoned once `origin_runs()` says no."""
        waiting_here = len(self._waiting_in.get(session_id, ()))
        if waiting_here >= self._max_per_session:
            raise ApprovalsFull(
                f"{waiting_here} approval requests of this session wait already (its most); "
                "wait for them to be answered, then try again"
            )
        if len(self._answered) >= self._max_total:
            raise ApprovalsFull(
                f"{len(self._answered)} approval requests wait on this service already (its "
                "most); wait for them to be answered, then try again"
            )
        entry = made_by
        timeout_s, bounded = self.timeout_s, False
        left: float | None = None
        if entry is not None and entry.deadline is not None:
            left = entry.deadline - time.monotonic() - entry.margin_s
        elif entry is None and waits_end_at is not None:
            left = waits_end_at - time.time()
        if left is not None and left < timeout_s:  # its execution's time limit comes first
            timeout_s, bounded = max(0.0, left), True
        now = time.time()
        record = ApprovalRecord(
            id="ap-" + secrets.token_hex(8),
            kind=kind,
            session_id=session_id,
            owner=owner,
            principal=self._name_of(owner),
            subject=_capped(subject, MAX_SUBJECT_CHARS) or "",
            arguments=_kept_arguments(arguments) if arguments is not None else None,
            code=_capped(code, MAX_CODE_CHARS),
            created_at=now,
            expires_at=now + timeout_s,
        )
        answered = self._answered[record.id] = asyncio.Event()
        in_session = self._waiting_in.setdefault(session_id, set())
        in_session.add(record.id)
        if entry is not None:
            entry.waiting.add(record.id)
        helpers: list[asyncio.Task[None]] = []
        started = time.monotonic()
        try:
            await self._store_of().put_approval(record)
            self._record(
                audit_kinds.APPROVAL_REQUESTED,
                record,
                details={"approval_id": record.id, "kind": kind, "subject": record.subject},
            )
            helpers = self._ask_helpers(record)
            final = await self._wait(record, answered, timeout_s, bounded, origin_runs)
        except asyncio.CancelledError:  # its caller left: no one need answer any more
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._decide(
                        record, "expired", ABANDONED, "the call was abandoned before an answer"
                    )
                )
            raise
        finally:
            for task in helpers:
                task.cancel()
            self._answered.pop(record.id, None)
            self._abandoned.pop(record.id, None)
            in_session.discard(record.id)
            if not in_session and self._waiting_in.get(session_id) is in_session:
                del self._waiting_in[session_id]
            if entry is not None:
                entry.waiting.discard(record.id)
        return ApprovalOutcome(
            kind=kind,
            subject=_capped(subject, 200) or "",
            approval_id=record.id,
            waited_s=round(time.monotonic() - started, 3),
            decision="approved" if final.state == "approved" else "denied",
            decided_by=final.decided_by,
            reason=final.reason,
        )

    async def gate(
        self,
        kind: Literal["execution", "command"],
        *,
        session_id: str,
        owner: str,
        subject: str,
        code: str | None = None,
    ) -> ApprovalOutcome:
        """Wait for a human before an execution or a command runs: the outcome when approved;
        ApprovalDenied (403) saying who denied it and why otherwise."""
        outcome = await self.request(
            kind, session_id=session_id, owner=owner, subject=subject, code=code
        )
        if not outcome.approved:
            raise ApprovalDenied(
                f"this {kind} waited {outcome.waited_s:.1f} s for a human's approval and was "
                f"{outcome.explain()} (approval {outcome.approval_id}); it did not run"
            )
        return outcome

    def _name_of(self, owner: str) -> str:
        try:
            return self._principal_of(owner).name
        except Exception:  # a name is for reading: never a reason to fail a request
            return owner[:12]

    def _ask_helpers(self, record: ApprovalRecord) -> list[asyncio.Task[None]]:
        """The webhook and the session's responder, asked at once beside the wait."""
        tasks: list[asyncio.Task[None]] = []
        if self._webhook is not None:
            tasks.append(asyncio.ensure_future(self._ask_webhook(self._webhook, record)))
        stack = self._responders.get(record.session_id)
        if stack and self._may_self_answer(record.owner):
            tasks.append(asyncio.ensure_future(self._ask_responder(stack[-1], record)))
        return tasks

    def _may_self_answer(self, owner: str) -> bool:
        """An MCP client answers as its key: only a key that may answer its own requests."""
        try:
            return self._principal_of(owner).may_answer(owner)
        except Exception:
            return False

    async def _ask_webhook(self, webhook: ApprovalWebhook, record: ApprovalRecord) -> None:
        answer = await webhook.notify(record)
        if answer is not None:
            state: ApprovalState = "approved" if answer.approve else "denied"
            await self._decide(record, state, WEBHOOK, answer.reason)

    async def _ask_responder(self, respond: Responder, record: ApprovalRecord) -> None:
        try:
            answer = await respond(record)
        except Exception:  # a front that cannot ask leaves it to the other ways
            log.warning("approval %s: the session's responder failed", record.id, exc_info=True)
            return
        if answer is not None:
            approve, reason = answer
            state: ApprovalState = "approved" if approve else "denied"
            await self._decide(record, state, MCP, _capped(reason, MAX_REASON_CHARS))

    async def _wait(
        self,
        record: ApprovalRecord,
        answered: asyncio.Event,
        timeout_s: float,
        bounded: bool,
        origin_runs: Callable[[], Awaitable[bool]] | None = None,
    ) -> ApprovalRecord:
        """The decided record: answered here, found decided in the store, abandoned, or
        timed out (`bounded`: sooner than approval_timeout_s, by its execution's limit)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(POLL_S, left)):
                    await answered.wait()
            why_abandoned = self._abandoned.get(record.id)
            if why_abandoned is None and origin_runs is not None and not await origin_runs():
                why_abandoned = EXECUTION_ENDED  # on another replica
            if why_abandoned is not None:
                return await self._end_abandoned(record, why_abandoned)
            found = await self._store_of().get_approval(record.id)
            if found is not None and found.state != "pending":
                return found
        why = f"no one answered within {_seconds(timeout_s)} s"
        if bounded:
            why += " (the time its execution had left)"
        decided = await self._decide(record, "denied", TIMEOUT, why)
        if decided is not None:
            return decided
        # Answered just before the timeout's decision:
        found = await self._store_of().get_approval(record.id)
        if found is None or found.state == "pending":  # gone from the store: still a denial
            return record.model_copy(update={"state": "denied", "decided_by": TIMEOUT})
        return found

    async def _end_abandoned(self, record: ApprovalRecord, why: str) -> ApprovalRecord:
        """The request decided as abandoned, or as it was decided just before."""
        decided = await self._decide(record, "expired", ABANDONED, why)
        if decided is not None:
            return decided
        found = await self._store_of().get_approval(record.id)
        if found is not None and found.state != "pending":
            return found
        return record.model_copy(  # gone from the store: abandoned all the same
            update={"state": "expired", "decided_by": ABANDONED, "reason": why}
        )

    # --- answering --------------------------------------------------------------------------

    async def _decide(
        self, record: ApprovalRecord, state: ApprovalState, by: str, reason: str | None
    ) -> ApprovalRecord | None:
        """Write a decision if the request is still pending (the one answer that wins), wake
        its waiter here, and record it; the decided record, or None if it was decided already."""
        decided = await self._store_of().decide_approval(record.id, state, by, reason, time.time())
        if decided is None:
            return None
        event = self._answered.get(record.id)
        if event is not None:
            event.set()
        self._record(
            audit_kinds.APPROVAL_DECIDED,
            decided,
            status=state,
            duration_s=(decided.decided_at or time.time()) - decided.created_at,
            details={
                "approval_id": decided.id,
                "kind": decided.kind,
                "subject": decided.subject,
                "decided_by": by,
                "reason": reason,
            },
        )
        return decided

    async def answer(
        self, approval_id: str, approve: bool, reason: str | None, by: Principal
    ) -> ApprovalRecord:
        """A human's answer: 404 for a request `by` may not see, 403 for one it may see but
        not answer, 409 for one already decided; the decided record."""
        record = await self.get(approval_id, by)
        if not by.may_answer(record.owner):
            raise ApprovalForbidden(
                f"key {by.name!r} may not answer approval requests of its own sessions: its "
                "policy's rule `self_approve` is off. An admin key answers them (or ask an admin "
                "to change the rule: code-interpreter keys set-policy)"
            )
        if record.state == "pending" and time.time() > record.expires_at + LATE_S:
            record = await self._expire(record)  # its waiter is gone: no answer can matter
        if record.state != "pending":
            raise ApprovalAlreadyDecided(_decided_text(record))
        state: ApprovalState = "approved" if approve else "denied"
        decided = await self._decide(record, state, by.name, _capped(reason, MAX_REASON_CHARS))
        if decided is None:
            found = await self._store_of().get_approval(approval_id)
            raise ApprovalAlreadyDecided(_decided_text(found or record))
        return decided

    async def get(self, approval_id: str, viewer: Principal) -> ApprovalRecord:
        """One request `viewer` may see (its own sessions', or any for an admin), else 404."""
        record = await self._store_of().get_approval(approval_id)
        if record is None or not (viewer.admin or record.owner == viewer.id):
            raise ApprovalNotFound(f"no approval request {approval_id!r}")
        return record

    async def list_requests(
        self,
        viewer: Principal,
        *,
        state: ApprovalState | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[ApprovalRecord]:
        """Requests `viewer` may see, newest first: an admin's are everyone's. A pending one
        whose waiter died with its replica is shown (and kept) as the denial it became."""
        owner = None if viewer.admin else viewer.id
        found = await self._store_of().approvals(
            owner=owner, state=state, session_id=session_id, limit=limit
        )
        now = time.time()
        shown = []
        for record in found:
            if record.state == "pending" and now > record.expires_at + LATE_S:
                record = await self._expire(record)
                if state == "pending":
                    continue
            shown.append(record)
        return shown

    async def pending(self, viewer: Principal) -> list[ApprovalRecord]:
        return await self.list_requests(viewer, state="pending")

    async def _expire(self, record: ApprovalRecord) -> ApprovalRecord:
        why = f"no one answered within {self.timeout_s:g} s"
        decided = await self._decide(record, "denied", TIMEOUT, why)
        if decided is not None:
            return decided
        return await self._store_of().get_approval(record.id) or record

    def _record(
        self,
        kind: str,
        record: ApprovalRecord,
        *,
        status: str | None = None,
        duration_s: float | None = None,
        details: dict[str, Any],
    ) -> None:
        if self._audit is not None:
            self._audit.record(
                kind,
                owner=record.owner,
                session_id=record.session_id,
                status=status,
                duration_s=duration_s,
                details=details,
            )


def _seconds(value: float) -> str:
    """`10`, `3.2`, `86400`: a wait as people read it."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _decided_text(record: ApprovalRecord) -> str:
    by = f" by {record.decided_by}" if record.decided_by else ""
    why = f" ({record.reason})" if record.reason else ""
    return f"approval request {record.id} was already decided: {record.state}{by}{why}"
