"""A whole-machine pause keeps every language's kernel, not Python's alone: the R kernel of a
gvisor sandbox on the full image comes back the same process, its variables in place."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandbox import create_backend
from sandbox.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import require_backend, small_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
async def gvisor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GvisorBackend]:
    """A gvisor backend of the module's own: its machines, and their images, are these tests'."""
    require_backend("gvisor")
    backend = create_backend("gvisor", state_dir=tmp_path_factory.mktemp("gv-lang"))
    assert isinstance(backend, GvisorBackend)
    if "r" not in await backend.languages(small_spec(image=FULL_IMAGE)):
        pytest.fail(f"{FULL_IMAGE} has no R kernel: `make image` builds it with R")
    yield backend
    await backend.close()


async def test_r_and_python_variables_and_the_r_kernel_itself_survive_a_pause(
    gvisor: GvisorBackend,
) -> None:
    sb = await gvisor.create(small_spec(image=FULL_IMAGE))
    try:
        assert (await sb.execute("py_kept = 'from python'")).status == "ok"
        # R has no way to pickle an environment's closures: this one counts in its own frame.
        r_state = await sb.execute(
            "r_kept <- c(4, 2)\n"
            "counter <- local({n <- 0; function() {n <<- n + 1; n}})\n"
            "counter(); cat(Sys.getpid(), counter(), '\\n')",
            language="r",
            timeout_s=120,
        )
        assert r_state.status == "ok", r_state
        r_pid, counted = r_state.stdout.split()
        assert counted == "2", r_state
        assert sorted(sb.started_languages) == ["python", "r"]
        handle = await sb.suspend()
        assert handle is not None, "the machine was not saved whole"
        assert (gvisor.paused_dir / handle / "image").is_dir()
    except BaseException:
        await sb.close()
        raise
    woken = await gvisor.wake(handle, sb.spec)
    try:
        assert isinstance(woken, GvisorSandbox)
        after = await woken.execute(
            "cat(Sys.getpid(), paste(r_kept, collapse = ''), counter(), '\\n')", language="r"
        )
        assert after.status == "ok", after
        # The same process (gVisor keeps its pids), the vector and the closure's count with it.
        assert after.stdout.split() == [r_pid, "42", "3"], after
        assert (await woken.execute("py_kept")).text == "'from python'"
        assert sorted(woken.started_languages) == ["python", "r"]
    finally:
        await woken.close()
