"""How the Docker backend names a kernel's death, from what the engine's event stream says.

The engine's own events are fed to the backend's death watch, beside a real engine (which knows
none of these containers): a death is blamed on memory only for an OOM kill reported just before
it by the engine's clock (not by when the reports were read, which a busy service reads late);
a death with no readable evidence says nothing can tell (it once said "not for lack of memory");
and reports of containers nobody watches do not pile up.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import docker
import pytest

from sandbox.backends.docker_container import (
    MAX_REPORTS,
    REPORT_KEPT_S,
    DeathWatch,
    KernelContainer,
)
from sandbox.kernel.process import CANNOT_TELL, KernelExit
from tests.conftest import require_backend

SECOND_NS = 1_000_000_000
START_NS = 1_800_000_000 * SECOND_NS


@pytest.fixture
def deaths() -> Iterator[DeathWatch]:
    require_backend("docker")
    client = docker.from_env()
    watch = DeathWatch(client, f"test-deaths-{secrets.token_hex(4)}")  # no container has it
    yield watch
    watch.close()
    client.close()


def event(action: str, container_id: str, at_ns: int, exit_code: int = 137) -> dict[str, object]:
    attributes = {"exitCode": str(exit_code)} if action == "die" else {}
    return {
        "id": container_id,
        "status": action,
        "timeNano": at_ns,
        "Actor": {"Attributes": attributes},
    }


async def death_after(deaths: DeathWatch, *events: dict[str, object]) -> KernelExit:
    container_id = str(events[-1]["id"])
    process = KernelContainer(None, asyncio.get_running_loop().create_future())
    deaths.watch(container_id, process)
    for each in events:
        deaths._handle(each)
    return await asyncio.wait_for(process.wait(), 10)


async def test_memory_is_blamed_by_the_engines_clock(deaths: DeathWatch) -> None:
    # Both reports read at once, as a service busy elsewhere would: 6 s apart by the engine.
    late = await death_after(
        deaths, event("oom", "c-late", START_NS), event("die", "c-late", START_NS + 6 * SECOND_NS)
    )
    assert not late.out_of_memory and "not for lack of memory" in late.reason, late
    soon = await death_after(
        deaths, event("oom", "c-soon", START_NS), event("die", "c-soon", START_NS + SECOND_NS // 20)
    )
    assert soon.out_of_memory and "ran out of memory" in soon.reason, soon


async def test_a_death_with_no_readable_evidence_says_nothing_can_tell(
    deaths: DeathWatch,
) -> None:
    # No OOM report, and the engine has no such container to ask for its OOM flag.
    gone = await death_after(deaths, event("die", "c-gone", START_NS))
    assert CANNOT_TELL in gone.reason and "not for lack of memory" not in gone.reason, gone
    # Found dead after the stream broke (no death event at all): the same.
    process = KernelContainer(None, asyncio.get_running_loop().create_future())
    deaths.watch("c-vanished", process)
    await asyncio.to_thread(deaths._recheck)
    vanished = await asyncio.wait_for(process.wait(), 10)
    assert CANNOT_TELL in vanished.reason, vanished


def test_reports_of_containers_nobody_watches_are_bounded(deaths: DeathWatch) -> None:
    for i in range(MAX_REPORTS + 500):
        deaths._handle(event("oom", f"c-{i}", START_NS))
        deaths._handle(event("kill", f"c-{i}", START_NS))
    assert len(deaths._oom) == len(deaths._killed) == MAX_REPORTS
    later = START_NS + int(REPORT_KEPT_S * SECOND_NS) + 1
    deaths._handle(event("oom", "c-last", later))
    assert list(deaths._oom) == ["c-last"]


async def test_an_oom_kill_long_before_a_watched_containers_death_is_kept_and_not_blamed(
    deaths: DeathWatch,
) -> None:
    """Kept: found missing, only the engine's OOM flag would be left, which stays set for the
    container's life (a command's OOM kill then blamed for any later death)."""
    process = KernelContainer(None, asyncio.get_running_loop().create_future())
    deaths.watch("c-long", process)
    deaths._handle(event("oom", "c-long", START_NS))
    hour = 3600 * SECOND_NS
    deaths._handle(event("oom", "c-other", START_NS + hour))  # stale reports are dropped now
    deaths._handle(event("die", "c-long", START_NS + 2 * hour))
    death = await asyncio.wait_for(process.wait(), 10)
    assert not death.out_of_memory and "not for lack of memory" in death.reason, death
