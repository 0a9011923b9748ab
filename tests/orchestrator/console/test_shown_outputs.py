"""The console's reading of kept outputs when, in a cluster, the shared store fails for a while:
the page says so instead of failing whole, and reads the output again once the store answers
(a failure is never remembered as the output)."""

from __future__ import annotations

import uuid

from code_interpreter_wire.results import Execution
from orchestrator.console.shown_outputs import ShownOutputs
from tests.orchestrator.conftest import store_refusing
from tests.orchestrator.local_service import local_service


async def test_a_store_that_fails_is_said_and_read_again_later(redis_url: str) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    async with local_service(
        "owner-key-0123456789", "shown", store_url=redis_url, store_prefix=prefix
    ) as service:
        kept_id = await service.files._outputs.save("s1", Execution(stdout="from the store"))
        shown = ShownOutputs(service)
        with store_refusing(redis_url) as password:  # it refuses every replica
            down = await shown.of("s1", kept_id)
        assert down.missing is not None and "cannot be read just now" in down.missing
        assert "shared session store" in down.missing and password not in down.missing
        back = await shown.of("s1", kept_id)
        assert back.missing is None and back.stdout.text == "from the store"
