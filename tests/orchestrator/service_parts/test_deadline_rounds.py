"""Fronts with deadlines of their own (E2B's sandbox timeouts) run them on the service's one
deadline sweeper (Sweeps.deadlines), not on a sweeper task of their own: every held round runs
each tick, a round that fails does not stop the others, and the task ends with the last round."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.service import Service

pytestmark = pytest.mark.unit


async def test_one_sweeper_runs_every_fronts_deadline_rounds(tmp_path: Path) -> None:
    settings = Settings(
        state_dir=tmp_path, auth_disabled=True, backends=["local"], reap_interval_s=0.01
    )
    sweeps = Service(settings).sweeps
    first_ran, second_ran = asyncio.Event(), asyncio.Event()
    failures = 0

    async def failing_round() -> None:
        nonlocal failures
        failures += 1
        first_ran.set()
        raise RuntimeError("this round broke")

    async def second_round() -> None:
        if failures >= 2:  # it ran on after the other round failed, more than once
            second_ran.set()

    async with sweeps.deadlines(failing_round), sweeps.deadlines(second_round):
        sweeper = sweeps._deadline_sweeper
        assert sweeper is not None
        await asyncio.wait_for(first_ran.wait(), 10)
        await asyncio.wait_for(second_ran.wait(), 10)
        assert sweeps._deadline_sweeper is sweeper  # one task serves both rounds
    assert sweeps._deadline_sweeper is None and sweeper.done()
