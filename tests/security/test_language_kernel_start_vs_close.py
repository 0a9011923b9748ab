"""Review (issue 16): a sandbox closed while one of its other-language kernels is starting.

`KernelSandbox.close()` closes the kernels in `_drivers`, then tears the sandbox down (its
directories, its cgroup, its host uid given back for another sandbox). A kernel still starting
in `_driver_for` is not in `_drivers` yet: it is killed only once its start-up ends, up to the
start-up timeout later. Until then a process of the closed sandbox runs on, as a uid that may
already belong to the next sandbox (local), or a container of it is left (Docker).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import docker
import pytest

from sandbox import Backend
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(300)

# R reads this profile before IRkernel answers: a start-up as slow as a loaded machine's.
SLOW_PROFILE = "/workspace/slow_profile.R"


def _processes_of_uid(uid: int) -> list[str]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            text = status.read_text()
            uids = next(line for line in text.splitlines() if line.startswith("Uid:"))
            if int(uids.split()[1]) == uid:
                name = next(line for line in text.splitlines() if line.startswith("Name:"))
                found.append(f"{status.parent.name} {name.split()[1]}")
    return found


def _containers_of(sandbox_id: str) -> list[str]:
    client = docker.from_env()
    try:
        return [
            c.name
            for c in client.containers.list(
                all=True, ignore_removed=True, filters={"name": sandbox_id}
            )
        ]
    finally:
        client.close()


async def test_nothing_of_a_sandbox_outlives_its_close_while_a_language_kernel_starts(
    backend: Backend,
) -> None:
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(env={"R_PROFILE_USER": SLOW_PROFILE}, **image))
    assert isinstance(sb, KernelSandbox)
    uid = getattr(sb.driver._launcher, "host_uid", None)  # local: the sandbox's host uid
    wrote = await sb.execute(f"open({SLOW_PROFILE!r}, 'w').write('Sys.sleep(40)\\n')")
    assert wrote.ok, wrote
    starting = asyncio.ensure_future(sb.execute("cat(1)", language="r", timeout_s=120))
    connection = sb.dirs.kernel_of("r") / "conn-1.json"
    deadline = time.monotonic() + 60
    while not connection.exists():  # written just before the kernel is launched
        assert time.monotonic() < deadline, "the R kernel never began to start"
        await asyncio.sleep(0.05)
    await asyncio.sleep(3)  # launched: bwrap or the container runs, R sleeps in its profile
    try:
        await sb.close()
        if backend.name == "docker":
            left = [f"container {name}" for name in _containers_of(sb.id)]
        else:
            assert uid is not None
            left = [f"process {p} as uid {uid}" for p in _processes_of_uid(uid)]
        left += [f"cgroup {d}" for d in Path("/sys/fs/cgroup").glob(f"*/code-interpreter/{sb.id}")]
        assert not left, f"the closed sandbox left behind: {left}"
    finally:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(starting, 120)
