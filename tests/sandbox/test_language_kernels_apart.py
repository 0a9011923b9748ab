"""Review (issue 16): Python's kernel beside other languages' kernels on the local backend.

Python's `BwrapKernel.kill` waits for the sandbox's whole cgroup to empty before its successor
starts (`owns_group`). Once another language's kernel runs, that group is never empty: every
replacement of Python's kernel (a restart, a death, a time limit it ignores) waits the full
`wait_empty` bound and logs that processes outlived it, and the wait no longer tells whether
Python's own leftovers are gone.
"""

from __future__ import annotations

import logging

import pytest

from sandbox import Backend
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(300)


async def test_restarting_python_does_not_wait_for_another_languages_kernel(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(**image))
    try:
        started = await sb.execute("echo bash runs", language="bash", timeout_s=120)
        assert started.stdout == "bash runs\n", started
        with caplog.at_level(logging.WARNING, logger="sandbox.cgroups"):
            await sb.restart("python")
            died = await sb.execute("import os; os.kill(os.getpid(), 9)")
            assert not died.ok
        waited = [r.getMessage() for r in caplog.records if "outlived its kernel" in r.getMessage()]
        assert not waited, f"Python's kernel waited for the bash kernel to exit: {waited}"
        after = await sb.execute("print(1 + 1)")
        assert after.stdout == "2\n"
    finally:
        await sb.close()
