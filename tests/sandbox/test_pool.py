"""A warm pool warms its sandboxes as background work: while one waits in the pool (its
preload included) its cgroup's CPU weight is the background one, so a live session's cells come
first on a busy host; handed over, it is a live session's again. The replacement of a sandbox
handed over starts a moment later, unless the pool ran dry. Real backends, real cgroups."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from sandbox import Backend, cgroups
from sandbox.cgroups import BACKGROUND_SHARES, LIVE_SHARES, PARENT, ROOT, SandboxCgroup
from sandbox.pool import MAX_PRELOAD_FAILURES, WarmPool
from tests.conftest import small_spec


async def filled(pool: WarmPool, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while pool.ready < 1:
        assert time.monotonic() < deadline, "the pool did not fill"
        await asyncio.sleep(0.05)


def shares(sandbox_id: str) -> int:
    return int(Path(ROOT, "cpu", PARENT, sandbox_id, "cpu.shares").read_text())


async def test_a_pool_warms_as_background_work_and_hands_over_a_live_session(
    backend: Backend,
) -> None:
    assert backend.capabilities.warm_pool
    if not cgroups.available() and not os.environ.get("CI"):
        pytest.skip("needs root and writable cgroup v1 hierarchies")
    pool = WarmPool(backend, small_spec(), 1, preload="import colorsys\n")
    pool.fill()
    try:
        await filled(pool)
        waiting = pool._ready[0]
        assert shares(waiting.id) == BACKGROUND_SHARES
        taken = pool.take()
        assert taken is waiting
        try:
            assert shares(taken.id) == LIVE_SHARES
            # The preload ran, at the background weight (nothing else imports colorsys).
            ran = await taken.execute("import sys; 'colorsys' in sys.modules")
            assert ran.text == "True"
        finally:
            await taken.close()
    finally:
        await pool.close()


@pytest.mark.parametrize("background", [True, False])
def test_a_sandbox_without_a_cgroup_keeps_its_weight(background: bool) -> None:
    assert SandboxCgroup("no-such-sandbox").weigh(background=background) is False


async def test_a_refill_waits_a_moment_unless_the_pool_ran_dry(backend: Backend) -> None:
    # A delay no test outlives: whether the refill started is read right after each take.
    pool = WarmPool(backend, small_spec(), 1, refill_delay_s=3600)
    pool.fill()
    try:
        await filled(pool)
        taken = pool.take()
        assert taken is not None
        await taken.close()
        assert pool._starting == 0 and pool._refill is not None  # later, not now
        assert pool.take() is None  # dry: demand outruns the pool, so it refills at once
        assert pool._starting == 1
    finally:
        await pool.close()
    assert pool._refill is None or pool._refill.cancelled()


async def test_a_preload_that_keeps_failing_is_given_up_and_the_pool_still_serves(
    backend: Backend,
) -> None:
    pool = WarmPool(backend, small_spec(), 1, preload="import no_such_module_for_this_test\n")
    pool.fill()
    try:
        await filled(pool)  # after MAX_PRELOAD_FAILURES tries, without the preload
        assert pool.preload == "" and pool.preload_failures == MAX_PRELOAD_FAILURES
        taken = pool.take()
        assert taken is not None
        try:
            assert (await taken.execute("1+1")).text == "2"
        finally:
            await taken.close()
    finally:
        await pool.close()
