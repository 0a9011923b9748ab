"""Channels: what a session's sandbox reaches the host through. Its host tools (a channel on
its socket, or relayed when its sandbox is on another machine) and its egress proxy; opened
when a session starts or resumes, closed when it ends, pauses or fails to resume."""

from __future__ import annotations

import logging

from code_interpreter_wire.network_policy import NetworkPolicy
from orchestrator.cluster.shared import RelayedTools
from orchestrator.cluster.tool_relay import ToolRelays
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.tool_guard import SessionToolGuard
from orchestrator.host_tools import ChannelLimits, HostTool, ToolChannel, ToolRegistry, UnknownTools
from orchestrator.host_tools.describe import summaries
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.errors import ToolsNotAvailable
from orchestrator.session_egress import SessionEgress
from orchestrator.sessions import Session
from orchestrator.settings_sections import ChannelSection, EgressSection
from orchestrator.state_store import SessionRecord
from orchestrator.vault.vault import Vault
from sandbox import Sandbox
from sandbox.egress.outbox import EgressReport

log = logging.getLogger(__name__)


class Channels:
    def __init__(
        self,
        settings: ChannelSection,
        egress: EgressSection,
        registry: ToolRegistry,
        admission: Admission,
        approvals: Approvals,
        trail: AuditTrail,
        vault: Vault,
    ) -> None:
        """`registry`: the host tools sessions may call (configured from the settings here);
        `egress`: the settings of sessions' egress proxies; `vault`: the keys' secrets their
        proxies bind (orchestrator/vault/)."""
        self.settings = settings
        self._registry = registry
        self._registry.configure(settings.host_tools)
        self._admission = admission
        self._approvals = approvals
        self._trail = trail
        self._channels: dict[str, ToolChannel] = {}  # session id -> its tool channel
        self._relays = ToolRelays()  # host tools of sessions whose sandbox is elsewhere
        self._vault = vault
        self._egress = SessionEgress(egress, vault, on_connection=trail.egress_connection)

    async def start(self) -> None:
        await self._registry.start()
        self._registry.select(self.default_tools())  # all must exist

    async def close(self) -> None:
        """Close every session's channels (the host tools themselves stay: `close_tools`)."""
        await self._relays.close()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        await self._egress.close_all()

    async def close_tools(self) -> None:
        """Stop the host tools (their MCP servers): last, once nothing can call them."""
        await self._registry.close()

    # --- host tools
    def default_tools(self) -> list[str]:
        """The host tools a session the model tool starts by itself is given."""
        return self.settings.host_tools.session_default

    def select(self, names: list[str]) -> dict[str, HostTool]:
        """The named host tools; ToolsNotAvailable naming those that are not registered."""
        try:
            return self._registry.select(names)
        except UnknownTools as exc:
            raise ToolsNotAvailable(str(exc)) from None

    def summaries(self, names: list[str]) -> list[tuple[str, str]]:
        """(call signature, summary) of each named host tool, for the tool's description."""
        return summaries(self._registry.select(names).values())

    def session_tools(self, session: Session) -> list[str]:
        channel = self._channels.get(session.id)
        return list(channel.tools) if channel is not None else []

    def serves(self, session_id: str) -> bool:
        """Whether the session has host tools (its runs name their origin for their calls)."""
        return session_id in self._channels

    async def open_tools(
        self, session: Session, tools: dict[str, HostTool], *, attached: bool = False
    ) -> None:
        """Serve a session's host tools; `attached`: a session another replica made, whose
        manifest that replica wrote (every replica has the same host-tool settings). The channel
        is kept only once it serves: a failure leaves none, so a later attempt makes one."""
        t = self.settings.host_tools
        limits = ChannelLimits(
            call_timeout_s=t.call_timeout_s,
            max_call_bytes=t.max_call_bytes,
            max_result_bytes=t.max_result_bytes,
            max_calls_in_flight=t.max_calls_in_flight,
            approval_timeout_s=self.settings.approval_timeout_s,
        )
        owner = session.owner
        principals = self._admission
        guard = SessionToolGuard(  # its key's policy, approvals, an audit event per call
            self._approvals,
            session_id=session.id,
            owner=owner,
            policy_of=lambda: principals.principals.of(owner).policy,
            revoked=lambda: principals.principals.is_revoked(owner),
            audit=self._trail.log,
        )
        relayed = session.sandbox
        if isinstance(relayed, RelayedTools):  # its channel is on its own machine: relayed
            if self._relays.serves(session.id, relayed) and session.id in self._channels:
                return  # served already, on this very sandbox
            relay = ToolChannel.relayed(tools, limits, guard)
            await self._relays.start(session.id, relayed, relay, write_manifest=not attached)
            earlier = self._channels.get(session.id)
            self._channels[session.id] = relay
            if earlier is not None and earlier is not relay:
                earlier.close()  # an earlier sandbox's: its calls in flight are moot
            return
        channel = session.sandbox.host_channel
        assert channel is not None, "a backend that supports host tools made no channel"
        self._channels[session.id] = await ToolChannel.open(channel, tools, limits, guard)

    async def attached(self, session: Session, record: SessionRecord) -> None:
        """A session another replica made, now served here too: its host tools with it, and
        its egress records taken here too (so they keep coming if its replica goes)."""
        await self._egress.attach(session)
        # Served already, unless for an earlier sandbox of the session (a stale copy dropped
        # here, the session resumed elsewhere): then its relay moves to this one.
        if record.tools and not self._relays.serves(session.id, session.sandbox):
            try:  # the relay starts at once (no call here): it retries what fails itself
                tools = self._registry.select(record.tools)
                await self.open_tools(session, tools, attached=True)
            except UnknownTools as exc:
                log.warning("session %s: its host tools are not here: %s", session.id, exc)

    # --- egress
    async def secrets_env(
        self, owner: str, names: list[str], policy: NetworkPolicy
    ) -> dict[str, str]:
        """The environment of a new session asking for its key's secrets `names` (placeholders,
        the CA bundle's variables); refused (SecretsNotAvailable) before a sandbox is made."""
        if not names:
            return {}
        return await self._vault.session_env(owner, names, policy)

    async def open_egress(self, session: Session) -> None:
        """Start the session's egress proxy, if its sandbox has a network to proxy."""
        await self._egress.open(session)

    async def egress_report(self, session: Session, most: int) -> EgressReport | None:
        """The session's egress totals and latest `most` connections, if it has a proxy."""
        return await self._egress.report(session, most)

    async def close_for(self, session_id: str, *, sandbox: Sandbox | None = None) -> None:
        """Close what a session's sandbox reaches the host through: its tool channel and its
        egress proxy (when it ends, is paused, or fails to resume); what was typed into its
        processes is written to the audit log now (they are gone). `sandbox`: each only if it
        serves that one; one of a newer sandbox of the session (resumed through another
        replica and attached here since the pause began) stays, the other still closes."""
        self._trail.input.flush_session(session_id)
        if sandbox is None or not self._relays.serves_another(session_id, sandbox):
            await self._relays.stop(session_id)
            channel = self._channels.pop(session_id, None)
            if channel is not None:
                channel.close()
        if sandbox is None or not self._egress.serves_another(session_id, sandbox):
            await self._egress.close(session_id)
