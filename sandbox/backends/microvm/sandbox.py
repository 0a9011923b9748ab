"""A microvm sandbox: a gVisor-style machine sandbox (kernels, processes and channels through
the machine's agent) whose machine is a QEMU guest with a kernel of its own, and whose
workspace is a disk inside it, so its files are reached through the agent too."""

from __future__ import annotations

from pathlib import Path

from code_interpreter_wire.results import FileInfo
from sandbox.backends.gvisor.machine_sandbox import GvisorSandbox
from sandbox.backends.kernel_sandbox import file_info
from sandbox.backends.microvm.guest_files import GuestWorkspace


class MicrovmSandbox(GvisorSandbox):
    backend = "microvm"

    @property
    def guest_files(self) -> GuestWorkspace:
        return GuestWorkspace(self._machine.running, self._uid, self._uid)

    def _no_root_reason(self) -> str:
        return (
            "root is turned off in this service's microVMs (the operator's "
            "CODE_INTERPRETER_MICROVM_ROOT=false): every process runs as the sandbox's user"
        )

    async def _refuse_unsaveable(self) -> bool:
        return False  # a whole machine saves whatever it holds (its sockets too)

    # Each within this sandbox's share of file work, as the host-workspace backends' are.
    async def upload(self, path: str, data: bytes) -> FileInfo:
        async with self._file_slots:
            return file_info(await self.guest_files.write(path, data))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        async with self._file_slots:
            return await self.guest_files.read(path, max_bytes)

    async def export_file(self, path: str, dest: Path, *, max_bytes: int) -> int:
        async with self._file_slots:
            return await self.guest_files.copy_out(path, dest, max_bytes)

    async def import_file(self, path: str, source: Path) -> FileInfo:
        async with self._file_slots:
            return file_info(await self.guest_files.copy_in(path, source))

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        async with self._file_slots:
            entries = await self.guest_files.list_dir(path, recursive=recursive)
        return [file_info(e) for e in entries]

    async def remove_file(self, path: str) -> None:
        async with self._file_slots:
            await self.guest_files.remove(path)
