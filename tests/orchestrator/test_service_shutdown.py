"""A shutdown step that hangs is named in the log while it does (orchestrator/service.py), so a
replica that does not stop says where it is stuck."""

from __future__ import annotations

import asyncio
import logging

import pytest

from orchestrator import service as service_module

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class _Named(logging.Handler):
    """Sets `said` once the shutdown names the step."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "still closing the stores" in record.getMessage():
            self.said.set()


async def test_a_slow_shutdown_step_is_named_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_module, "SLOW_SHUTDOWN_STEP_S", 0.01)
    named = _Named()
    logging.getLogger("orchestrator.service").addHandler(named)
    release = asyncio.Event()
    try:
        waiting = asyncio.ensure_future(
            service_module._named_if_slow("closing the stores", release.wait())  # type: ignore[arg-type]
        )
        await named.said.wait()  # said while the step still runs
        assert not waiting.done()
        release.set()
        await waiting
    finally:
        logging.getLogger("orchestrator.service").removeHandler(named)


async def test_a_quick_step_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="orchestrator.service")

    async def quick() -> None:
        return None

    await service_module._named_if_slow("closing admission", quick())
    assert "shutdown" not in caplog.text
