"""Admission: what a request may have, decided once for every front door. Keys' policies
(docs/governance.md), the caps on sessions, the spec a session gets (limits, image, runtime, its
network policy), the time limits of code and commands, and the approvals a run waits for."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Literal

from pydantic import ValidationError

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from code_interpreter_wire.errors import FileTooLarge
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.network_policy import NO_NETWORK, NetworkPolicy
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.rest import CreateSessionRequest, LimitsRequest
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec, limit_ceilings
from orchestrator.governance import policy_checks
from orchestrator.governance.approvals import Approvals, Responder
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.policy import Principal
from orchestrator.governance.principals import Principals
from orchestrator.governance.stores.approval_store import ApprovalRecord, ApprovalState
from orchestrator.governance.stores.principal_store import PrincipalStore
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.errors import (
    ImageNotAllowed,
    LimitTooHigh,
    NetworkNotAllowed,
    PauseUnsupported,
    RuntimeNotAllowed,
    ShellToolOff,
    ToolsNotAvailable,
)
from orchestrator.sessions import Session, SessionManager
from orchestrator.settings_sections import AdmissionSection, AuthSection
from orchestrator.state_store import SessionRecord
from sandbox.backends.base import Backend
from sandbox.image_labels import FULL_IMAGE, template_name_of
from sandbox.languages import check_available

# The ceiling no request may pass, whatever it asks for: ResourceLimits' own upper bounds.
LIMITS_CEILING = limit_ceilings()


class Admission:
    def __init__(
        self,
        settings: AdmissionSection,
        auth: AuthSection,
        sessions: SessionManager,
        trail: AuditTrail,
        approvals: Approvals,
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        self._trail = trail
        self._approvals = approvals
        # Who each owner id is, and its policy: the settings' keys until start() reads the
        # store's too (docs/governance.md).
        self._auth = auth
        self.principals = Principals(auth, None)
        self._making: dict[str, int] = {}  # owner -> its sessions being made (max_sessions)

    async def start(self, store: PrincipalStore) -> None:
        self.principals = Principals(self._auth, store)
        await self.principals.start()

    async def close(self) -> None:
        await self.principals.close()

    # --- who a key is: what fronts ask before they answer or show anything
    def who(self, owner: str) -> Principal:
        """Who an owner id is, and its policy (docs/governance.md)."""
        return self.principals.of(owner)

    @property
    def auth_disabled(self) -> bool:
        """Auth is off: one user on a trusted machine, everyone `local`."""
        return self.principals.disabled

    def authenticate(self, key: str) -> Principal | None:
        """The principal of an API key (an empty one with auth off: `local`); None: it fails."""
        return self.principals.authenticate(key)

    def authenticate_digest(self, digest: str) -> Principal | None:
        """As `authenticate`, known by the key's digest alone (a console login's)."""
        return self.principals.authenticate_digest(digest)

    # --- approval requests: read and answered by humans through a front
    async def approval_requests(
        self,
        viewer: Principal,
        *,
        state: ApprovalState | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[ApprovalRecord]:
        """Requests `viewer` may see, newest first (an admin's: everyone's)."""
        return await self._approvals.list_requests(
            viewer, state=state, session_id=session_id, limit=limit
        )

    async def approval(self, approval_id: str, viewer: Principal) -> ApprovalRecord:
        return await self._approvals.get(approval_id, viewer)

    async def answer_approval(
        self, approval_id: str, approve: bool, reason: str | None, by: Principal
    ) -> ApprovalRecord:
        """A human's answer (404 unseen, 403 not theirs to answer, 409 decided)."""
        return await self._approvals.answer(approval_id, approve, reason, by)

    def approval_responder(
        self, session_id: str, respond: Responder
    ) -> contextlib.AbstractContextManager[None]:
        """While a front's call runs in the session, `respond` is asked its approvals too."""
        return self._approvals.responder(session_id, respond)

    # --- keys' policies: checked here, behind every front door
    @contextlib.contextmanager
    def enforcing(self, owner: str, session_id: str | None = None) -> Iterator[Principal]:
        """The owner's principal, to check a request against its policy; a refusal is kept
        in the audit log. A revoked key's is refused everything (its sessions end at the next
        sweep; until then, what still reaches them, e.g. an E2B sandbox token, runs nothing)."""
        try:
            who = self.principals.of(owner)
            if self.principals.is_revoked(owner):
                raise PolicyDenied.revoked(who.name)
            yield who
        except PolicyDenied as exc:
            self._trail.policy_denied(owner, session_id, exc)
            raise

    def check_commands(self, owner: str, session_id: str | None = None) -> None:
        """Refuse shell commands, background processes and terminals to a key whose policy
        says `commands: false` (PolicyDenied)."""
        with self.enforcing(owner, session_id) as who:
            policy_checks.check_commands(who)

    def check_language(self, session: Session, language: str | None) -> str:
        """The canonical name of a language the session has and its key may use: else
        UnknownLanguage, LanguageUnavailable (both name those there are) or PolicyDenied."""
        name = check_available(language or PYTHON, session.sandbox.languages)
        with self.enforcing(session.owner, session.id) as who:
            policy_checks.check_language(who, name)
        return name

    def allowed_tools(self, owner: str, names: list[str]) -> list[str]:
        """Of `names`, the host tools the key's policy allows (the others left out, unasked)."""
        return policy_checks.allowed_tools(self.principals.of(owner), names)

    async def approval_gate(
        self,
        session: Session,
        kind: Literal["execution", "command"],
        subject: str,
        code: str | None,
    ) -> list[ApprovalOutcome]:
        """Wait for a human when the session's key's policy gates this kind of run
        (approve_executions, approve_commands): [the approval], or [] when it does not;
        ApprovalDenied (403) when denied."""
        policy = self.principals.of(session.owner).policy
        if not (policy.approve_executions if kind == "execution" else policy.approve_commands):
            return []
        gated = await self._approvals.gate(
            kind, session_id=session.id, owner=session.owner, subject=subject, code=code
        )
        return [gated]

    # --- how many sessions
    @contextlib.asynccontextmanager
    async def session_slot(self, owner: str) -> AsyncIterator[None]:
        """Hold a place under the key's `max_sessions` while a session of its is made or
        resumed (beside the service's own cap per key, which the session manager keeps)."""
        who = self.principals.of(owner)
        if who.policy.max_sessions is None:
            yield
            return
        held = await self._sessions.held_by(owner)
        with self.enforcing(owner):
            policy_checks.check_session_count(who, held + self._making.get(owner, 0))
        self._making[owner] = self._making.get(owner, 0) + 1
        try:
            yield
        finally:
            self._making[owner] -= 1
            if not self._making[owner]:
                del self._making[owner]

    # --- what a new session gets
    async def admit(
        self,
        owner: str,
        request: CreateSessionRequest,
        spec: SandboxSpec | None,
        *,
        tools: bool,
        from_snapshot: bool,
    ) -> tuple[str, SandboxSpec]:
        """(backend name, spec) of a new session, refused now if its key's policy, the backend
        or the operator's ceilings do not allow what it asks. `spec`: one given whole by
        in-process code (an embedded session's), taken as it is past the request's ceilings."""
        with self.enforcing(owner) as who:  # none named: the default, or one the key may use
            name = request.backend or policy_checks.fit_backend(
                who, self.settings.default_backend, list(self._sessions.backends)
            )
            policy_checks.check_request(who, name, request)
        backend = self._sessions.backends.get(name)
        if from_snapshot and backend is not None and not self._sessions.saves_states(name):
            raise PauseUnsupported(name, shared=self._sessions.shared(name))
        if tools and backend is not None and not backend.capabilities.host_tools:
            raise ToolsNotAvailable(f"the {name} backend cannot give sandboxed code host tools")
        if request.runtime is not None and backend is not None:
            await self._check_runtime(name, backend, request.runtime)
        if spec is None:
            spec = self.spec_for(request)
            with self.enforcing(owner) as who:  # what it left unset, within the policy
                spec = policy_checks.fit_spec(
                    who,
                    spec,
                    request,
                    images=backend is not None and backend.capabilities.images,
                    default_image=self.settings.docker_image,
                    offered_images=self._offered_images(),
                )
        if backend is not None:
            self._check_network_holdable(name, backend, spec.network)
        return name, spec

    def fit_resumed(self, record: SessionRecord) -> tuple[SandboxSpec, list[str]]:
        """A paused session's spec under the operator's ceiling and its key's policy as they
        are now (either may have changed while it was paused), and what that changed."""
        spec = record.spec.model_copy(deep=True)
        notices: list[str] = []
        beyond = spec.network.beyond(self.settings.network_ceiling)
        if beyond:  # the operator lowered the ceiling while it was paused
            spec.network = NO_NETWORK
            notices.append(f"its network is now none: {beyond} (the operator's ceiling changed)")
        with self.enforcing(record.owner, record.id) as who:  # its key's policy may have too
            resumed_on = self._sessions.backends.get(record.backend)
            spec, changed = policy_checks.fit_resumed(
                who,
                record.backend,
                spec,
                images=resumed_on is not None and resumed_on.capabilities.images,
                default_image=self.settings.docker_image,
            )
        return spec, notices + changed

    def check_pause(self, session: Session) -> None:
        """PauseUnsupported where the session's backend keeps nothing across a pause."""
        if not self._sessions.pauses(session.backend):
            raise PauseUnsupported(session.backend, shared=self._sessions.shared(session.backend))

    def check_snapshot(self, session: Session) -> None:
        """PauseUnsupported where the session's backend cannot save its state."""
        if not self._sessions.saves_states(session.backend):
            raise PauseUnsupported(session.backend, shared=self._sessions.shared(session.backend))

    def spec_for(self, request: CreateSessionRequest) -> SandboxSpec:
        spec = self._sessions.default_spec()
        if request.limits is not None:
            spec.limits = self._limits(request.limits)
        if request.image is not None:
            allowed = self._offered_images()
            template = self.settings.docker_templates and template_name_of(request.image)
            if request.image not in allowed and not template:
                also = ", or a template's (code-interpreter template list)"
                raise ImageNotAllowed(
                    f"image {request.image!r} is not allowed here; allowed: {', '.join(allowed)}"
                    + (also if self.settings.docker_templates else "")
                )
            spec.image = request.image
        if request.runtime is not None and request.runtime != self._deployment_runtime():
            spec.runtime = request.runtime  # the deployment's own stays unset: pools fit it
        spec.host_tools = bool(request.tools)  # a pooled sandbox (no channel) will not fit
        if request.network is not None:
            spec.network = self.network_policy(request.network)
        return spec

    def _offered_images(self) -> list[str]:
        return list(self.settings.docker_images) or [self.settings.docker_image, FULL_IMAGE]

    def network_policy(self, asked: NetworkPolicy) -> NetworkPolicy:
        """`asked`, if it fits within the operator's ceiling; else `NetworkNotAllowed` saying
        what the ceiling allows."""
        why = asked.beyond(self.settings.network_ceiling)
        if why:
            raise NetworkNotAllowed(
                f"network policy refused: {why}. Ask for less, or ask the operator to raise "
                "the ceiling (network_ceiling)"
            )
        return asked

    def internet_for(self, owner: str) -> NetworkPolicy:
        """What "the internet" is for this key, where a front's caller asks for it by default
        (E2B's SDK does): the operator's `network_internet` policy, fitted within the network
        the key's policy allows, so asking for it is never refused."""
        return policy_checks.capped_network(self.who(owner), self.settings.internet_policy)

    def _check_network_holdable(self, name: str, backend: Backend, policy: NetworkPolicy) -> None:
        """Refuse a policy the backend cannot enforce whole, rather than drop part of it: a
        backend without our proxy (e2b) holds only all or nothing, so no deny rule either."""
        can = backend.capabilities
        if policy.mode not in can.network_modes:
            raise NetworkNotAllowed(
                f"the {name} backend cannot hold a {policy.mode} network policy (it can: "
                f"{', '.join(can.network_modes)}); use the local or docker backend"
            )
        deny = policy.deny or (self.settings.network_ceiling.deny if policy.enabled else ())
        if deny and not can.egress_rules:
            raise NetworkNotAllowed(
                f"the {name} backend cannot hold deny rules ({', '.join(map(str, deny[:4]))}, "
                "from the session's policy or the deployment's ceiling): its network is all or "
                "nothing; use the local or docker backend"
            )

    def _deployment_runtime(self) -> str:
        return self.settings.docker_runtime or "runc"

    async def _check_runtime(self, name: str, backend: Backend, runtime: str) -> None:
        """Refuse a runtime the backend has no choice of, or that is not both allowed by the
        operator and known to the engine; the refusal names those that are."""
        known = await backend.runtimes()
        if not known:
            raise RuntimeNotAllowed(
                f"the {name} backend has no choice of runtime (asked: {runtime!r}); "
                "use the docker backend, or leave runtime unset"
            )
        allowed = [r for r in self.settings.docker_runtimes if r in known]
        if runtime not in allowed:
            raise RuntimeNotAllowed(
                f"runtime {runtime!r} is not allowed here; allowed: {', '.join(allowed) or 'none'}"
            )

    def _limits(self, request: LimitsRequest) -> ResourceLimits:
        wanted = request.model_dump(exclude_none=True)
        for name, value in wanted.items():
            ceiling = LIMITS_CEILING[name]
            if value > ceiling:
                raise LimitTooHigh(
                    f"limits.{name}={value} is above this service's ceiling of {ceiling}"
                )
        # Validated whole: a zero or negative limit would mean "unlimited" to some engines.
        merged = {**self.settings.default_limits.model_dump(), **wanted}
        try:
            return ResourceLimits.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(f"limits.{e['loc'][0]}: {e['msg']}" for e in exc.errors())
            raise LimitTooHigh(problems) from None

    # --- time limits and sizes
    def execution_timeout(self, timeout_s: float | None) -> float:
        """An execution's time limit: the one asked for (None: the default), within the
        ceiling."""
        s = self.settings
        return min(timeout_s or s.execution_timeout_s, s.max_execution_timeout_s)

    def execution_ceiling(self) -> float:
        """The longest any execution may run: a front whose client keeps its own deadline
        (E2B's SDK disconnects at its `timeout`) asks for this."""
        return self.execution_timeout(self.settings.max_execution_timeout_s)

    def process_request(self, request: ProcessRequest) -> ProcessRequest:
        """Within the service's time ceiling: a command may run at most as long as code may."""
        ceiling = self.settings.max_execution_timeout_s
        timeout = min(request.timeout_s or ceiling, ceiling)
        return request.model_copy(update={"timeout_s": timeout})

    def upload_limit(self) -> int:
        """The largest file a caller may write into a workspace, in bytes."""
        return self.settings.max_upload_bytes

    def download_limit(self) -> int:
        """The largest file a caller may read out of a sandbox, in bytes."""
        return self.settings.max_download_bytes

    def check_upload_size(self, size: int) -> None:
        """Refuse a file over the upload limit: before a session is found or made for it."""
        limit = self.settings.max_upload_bytes
        if size > limit:
            raise FileTooLarge(f"the file is {size} bytes, over the upload limit of {limit}")

    def shell_tool_on(self) -> bool:
        """Whether the operator turned the `run_command` tool on (it is off by default)."""
        return self.settings.shell_tool

    def connection_idle_timeout(self) -> float:
        """The idle timeout of a session a model tool starts for an MCP connection: shorter
        than others, as clients that never end their connection are common."""
        return self.settings.mcp_idle_timeout_s

    def check_shell_tool(self) -> None:
        """Refuse the `run_command` tool unless the operator turned it on."""
        if not self.settings.shell_tool:
            raise ShellToolOff()

    def tool_timeout(self) -> float:
        """The model tools' own time limit, the one their descriptions say."""
        return self.settings.execution_timeout_s

    def shell_command(self, command: str, timeout_s: float | None) -> ProcessRequest:
        """A `run_command` tool call's request, within the tool's own time limit (the one its
        description says). ValidationError for a line no command can hold (e.g. a NUL)."""
        limit = self.tool_timeout()
        return ProcessRequest(command=command, timeout_s=min(timeout_s or limit, limit))
