"""A kernel slow to answer each request (a JVM starting on a loaded host) is still found to
answer: the start-up wait never asks faster than it is answered, and any reply counts."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

from sandbox.kernel.generation import answers, dispose, launch_generation
from sandbox.kernel.process import KernelExit

# A real ipykernel whose every kernel_info answer takes longer than the wait's first pause.
_SLOW_KERNEL = textwrap.dedent(
    """
    import sys, time
    from ipykernel.ipkernel import IPythonKernel
    from ipykernel.kernelapp import IPKernelApp

    class Slow(IPythonKernel):
        async def kernel_info_request(self, stream, ident, parent):
            time.sleep(float(sys.argv[1]))  # blocks the shell, as a busy JVM does
            return await super().kernel_info_request(stream, ident, parent)

    IPKernelApp.launch_instance(argv=["-f", sys.argv[2]], kernel_class=Slow)
    """
)


class _HostKernel:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    async def wait(self) -> KernelExit:
        return KernelExit.from_returncode(await self._proc.wait())

    async def kill(self) -> None:
        if self._proc.returncode is None:
            self._proc.kill()
        await self._proc.wait()

    def diagnostics(self) -> str:
        return ""


class _SlowLauncher:
    def __init__(self, kernel_dir: Path, seconds_per_answer: float) -> None:
        self._dir = kernel_dir
        self._seconds = seconds_per_answer

    async def launch(self, connection_file_in_sandbox: str) -> _HostKernel:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SLOW_KERNEL, str(self._seconds), connection_file_in_sandbox
        )
        return _HostKernel(proc)

    @property
    def kernel_dir(self) -> Path:
        return self._dir

    @property
    def kernel_dir_in_sandbox(self) -> str:
        return str(self._dir)

    @property
    def kernel_uid(self) -> int | None:
        return None


async def test_a_kernel_slower_to_answer_than_the_first_pause_is_found_to_answer(
    tmp_path: Path,
) -> None:
    (tmp_path / "k").mkdir()
    launcher = _SlowLauncher(tmp_path / "k", seconds_per_answer=1.5)
    kernel = await launch_generation(launcher, 1, frame_limit=1 << 20, text_limit=1 << 20)
    try:
        assert await answers(kernel, 90, lambda: False)
        # More requests than answers went out; the backlog left behind drains unread.
        assert not kernel.channels.replies
    finally:
        await dispose(kernel)
