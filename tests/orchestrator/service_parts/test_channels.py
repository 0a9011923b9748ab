"""Closing what a session's sandbox reaches the host through (Channels.close_for) when the
session has moved on: each of its relays closes only if it serves the sandbox being closed."""

from __future__ import annotations

import asyncio
import secrets

from orchestrator.service import Service
from tests.orchestrator.local_service import local_service


class Handle:
    """A sandbox as the relays tell one from another: by its id."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)


async def _forever() -> None:
    await asyncio.Event().wait()


async def _relayed(service: Service, session_id: str, tools: Handle, egress: Handle) -> None:
    """The session's host-tool relay serving `tools` and its egress relay `egress` here."""
    channels = service.channels
    await channels._relays.run(session_id, tools, _forever)
    await channels._egress._relays.run(session_id, egress, _forever)


async def test_a_pause_closes_the_relays_of_its_own_sandbox_only() -> None:
    async with local_service("owner", "channels") as service:
        channels = service.channels
        old, new = Handle(), Handle()
        # Resumed through another replica since the pause of `old` began: its host tools
        # already moved to `new` here, its egress records not yet.
        await _relayed(service, "s1", tools=new, egress=old)
        await channels.close_for("s1", sandbox=old)  # type: ignore[arg-type]
        assert channels._relays.serves("s1", new)  # the newer sandbox's stays
        assert "s1" not in channels._egress._relays  # the paused one's closed
        # And the other way round.
        await _relayed(service, "s2", tools=old, egress=new)
        await channels.close_for("s2", sandbox=old)  # type: ignore[arg-type]
        assert "s2" not in channels._relays
        assert channels._egress._relays.serves("s2", new)
        # Without a sandbox named (the session ended): everything goes.
        await channels.close_for("s2")
        assert "s2" not in channels._egress._relays
        await channels.close_for("s1")
        assert "s1" not in channels._relays
