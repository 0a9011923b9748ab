"""A gVisor machine sandbox: a `KernelSandbox` whose kernels and processes run in one machine
that gVisor saves whole, to pause it (`suspend`) or to keep a copy it runs on from
(`save_whole`, what snapshots and forks are made of)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from code_interpreter_wire.errors import SandboxError, StateNotSaved
from code_interpreter_wire.languages import PYTHON, canonical_language
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.gvisor.agent_channel import AgentChannel, AgentError
from sandbox.backends.gvisor.kernels import MachineKernelLauncher
from sandbox.backends.gvisor.machine import (
    Machine,
    MachineError,
    RestoreFailed,
)
from sandbox.backends.gvisor.machine_channels import channel_environment
from sandbox.backends.gvisor.machine_images import rekey_code, volume_places, write_manifest
from sandbox.backends.gvisor.processes import MachineSpawner
from sandbox.backends.gvisor.workspace_copy import copy_workspace
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.kernel.driver import KernelDriver
from sandbox.saved_report import REPORT_FILE, SavedState, StateTooLarge
from sandbox.state_dir import SessionDirs
from sandbox.tree_transfer import tree_bytes, tree_disk_bytes
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

IMAGE_DIR = "image"
WORKSPACE_DIR = "workspace"


class MachineHome(Protocol):
    """What a machine sandbox asks of its backend."""

    @property
    def paused_dir(self) -> Path: ...

    def hold_uid_for(self, handle: str, uid: int) -> None: ...

    def release_uid(self, uid: int) -> None: ...

    def finish_later(self, work: Awaitable[None]) -> None: ...

    async def machine_version(self) -> str: ...


class GvisorSandbox(KernelSandbox):
    backend = "gvisor"

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
        *,
        languages: list[str],
        make_driver: Callable[[str], KernelDriver],
        backend: MachineHome,
        machine: Machine,
        image: str,
        uid: int,
        launchers: dict[str, MachineKernelLauncher],
        uid_claimed: bool,
        kernel_path: str,
        root: bool,
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._kernel_path = kernel_path
        # Its root is gVisor's, with a root filesystem of its own in memory: offered unless
        # the operator turned it off (GvisorBackendConfig.root).
        self.has_root = root
        self._backend = backend
        self._machine = machine
        self._image = image
        self._uid = uid
        self._launchers = launchers
        self._uid_claimed = uid_claimed  # its claim on its uid is its own to give back

    def _channel(self) -> AgentChannel:
        channel = self._machine.channel
        if channel is None:
            raise SandboxError("the sandbox's machine is not running")
        return channel

    def spawner(self) -> MachineSpawner:
        # The kernels' PATH first: a process started from an argv finds what they find.
        return MachineSpawner(
            self._machine.running,
            self._uid,
            lambda: {"PATH": self._kernel_path, **channel_environment(self.spec)},
        )

    def _no_root_reason(self) -> str:
        return (
            "root is turned off in this service's gVisor machines (the operator's "
            "CODE_INTERPRETER_GVISOR_ROOT=false): every process runs as the sandbox's user. Run "
            "it so (`pip install` and `npm i -g` work, into the workspace), or ask the operator"
        )

    async def restart(self, language: str | None = None) -> None:
        """As on the other backends, where a new Python kernel is a new sandbox: the
        processes beside it end with it (the machine itself runs on)."""
        if language is None or canonical_language(language) == PYTHON:
            for process in self._processes.running() if self._processes is not None else []:
                await process.signal(signal.SIGKILL)
        await super().restart(language)

    async def adopt_processes(self, saved: list[dict[str, Any]]) -> None:
        """Processes the machine ran when saved, in this sandbox's table again."""
        if not saved:
            return
        table = self._process_table()
        spawner = self.spawner()
        for item in saved:
            request = ProcessRequest.model_validate(item["request"])
            try:
                spawned = await spawner.adopt(
                    int(item["pid"]), terminal=request.terminal is not None
                )
            except AgentError:  # it ended while the machine was being saved, and is gone
                continue
            table.adopt(spawned, request)

    async def rekey(self) -> None:
        """New keys and random streams for the kernels of a machine restored from a save other
        machines are restored from too (a template, a snapshot)."""
        for language, launcher in self._launchers.items():
            kernel = launcher.current
            code = rekey_code(language, key := secrets.token_hex(32))
            if kernel is None or code is None or language not in self.started_languages:
                continue
            await (await self._driver_for(language)).rekey(code, key)
            kernel.kept = dataclasses.replace(kernel.kept, key=key)

    def _saved_parts(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        kernels = {
            language: launcher.current.kept.as_json()
            for language, launcher in self._launchers.items()
            if launcher.current is not None and language in self.started_languages
        }
        running = self._processes.running() if self._processes is not None else []
        processes = [{"pid": p.pid, "request": p.request.model_dump(mode="json")} for p in running]
        return kernels, processes

    async def _manifest(self) -> dict[str, Any]:
        """What the image about to be taken holds; written last, once all of it is saved."""
        kernels, processes = self._saved_parts()
        return {
            "runsc": await self._backend.machine_version(),
            "image": self._image,
            "uid": self._uid,
            "host_tools": self.spec.host_tools,
            "network": self.spec.network.enabled,
            "volumes": [
                {"path": path, "read_only": read_only}
                for path, read_only in volume_places(self.spec)
            ],
            "kernels": kernels,
            "processes": processes,
        }

    @contextlib.asynccontextmanager
    async def _quiet(self) -> AsyncIterator[None]:
        """No code runs in any of its kernels while inside: what is saved is between cells."""
        if self.is_busy:
            raise SandboxError("the sandbox is running code; save it once the code ends")
        async with contextlib.AsyncExitStack() as stack:
            for driver in list(self._drivers.values()):
                await stack.enter_async_context(driver.quiet())
            yield

    async def _refuse_unsaveable(self) -> bool:
        channel = await self._machine.running()
        reasons = await channel.unsaveable()
        if reasons:
            log.info("machine %s cannot be saved whole (%s)", self.id, "; ".join(reasons))
        return bool(reasons)

    async def suspend(self) -> str | None:
        """Save the whole machine (kernels, processes, memory, files) and stop it. None where
        its gVisor cannot save what it holds (a network socket): the caller then saves the
        kernels' state instead, and the machine runs on until then."""
        handle = secrets.token_hex(12)
        paused = self._backend.paused_dir / handle
        if not await self.save_and_stop(paused):
            return None
        if self._uid_claimed:  # its processes run as it: its claim is the paused machine's now
            self._backend.hold_uid_for(handle, self._uid)
            self._uid_claimed = False
        # runsc's delete of the stopped machine takes a second or so: not the pause's to wait.
        self._backend.finish_later(self.close())
        return handle

    async def save_and_stop(self, into: Path) -> bool:
        """Save the whole machine into `into` (a new directory) and stop it: whether it was
        saved (if not, for what it holds, it runs on). Either way the caller closes it."""
        async with self._quiet():
            return await self._save_and_stop(into)

    async def _save_and_stop(self, into: Path) -> bool:
        if await self._refuse_unsaveable():
            return False
        await asyncio.to_thread(into.mkdir, mode=0o700, parents=True)
        try:
            manifest = await self._manifest()
            await self._machine.checkpoint(into / IMAGE_DIR)
        except MachineError as exc:
            shutil.rmtree(into, ignore_errors=True)
            log.warning("machine %s could not be saved whole: %s", self.id, exc)
            await self._reattach()
            return False
        except BaseException:
            shutil.rmtree(into, ignore_errors=True)
            raise
        try:  # nothing runs in it now: its workspace is still
            (into / WORKSPACE_DIR).mkdir(mode=0o700)
            await asyncio.to_thread(copy_workspace, self.dirs.workspace, into / WORKSPACE_DIR)
            await asyncio.to_thread(write_manifest, into, manifest)
        except BaseException as exc:
            shutil.rmtree(into, ignore_errors=True)
            await self.close()
            raise StateNotSaved(
                f"the machine was saved, its workspace could not be: {exc}"
            ) from exc
        return True

    async def save_whole(self, into: Path, *, max_bytes: int) -> SavedState | None:
        """Save the whole machine into `into` and run on from the image just taken: its
        kernels, processes and terminals carry on (their output of the second or so the save
        takes may be lost). None where its gVisor cannot save what it holds."""
        async with self._quiet():
            return await self._save_whole(into, max_bytes)

    async def _save_whole(self, into: Path, max_bytes: int) -> SavedState | None:
        if await self._refuse_unsaveable():
            return None
        await asyncio.to_thread(into.mkdir, mode=0o700, parents=True)
        workspace = into / WORKSPACE_DIR
        copied: list[bool] = []

        async def copy_files() -> None:  # while the machine is stopped: the files are still
            await asyncio.to_thread(workspace.mkdir, mode=0o700)
            await asyncio.to_thread(copy_workspace, self.dirs.workspace, workspace)
            copied.append(True)

        try:
            manifest = await self._manifest()
            try:
                await self._machine.checkpoint_and_go_on(into / IMAGE_DIR, copy_files)
            except RestoreFailed as exc:
                # Saved, but not running on: the save holds; the session goes on in a new
                # machine, its kernel's state lost (the next execution says so).
                log.warning("machine %s: %s", self.id, exc)
                if not copied:
                    raise StateNotSaved(
                        f"the machine was saved, its files were not: {exc}"
                    ) from exc
            except MachineError as exc:
                log.warning("machine %s could not be saved whole: %s", self.id, exc)
                channel = self._machine.channel
                if channel is not None and channel.detached and not channel.closed.done():
                    await self._reattach()
                await asyncio.to_thread(shutil.rmtree, into, True)
                return None
            state = await asyncio.to_thread(_measured, into)
            if state.bytes > max_bytes:
                raise StateTooLarge(
                    f"the whole machine takes {state.bytes} bytes, over the {max_bytes} allowed"
                )
            await asyncio.to_thread((into / REPORT_FILE).write_text, state.model_dump_json())
            await asyncio.to_thread(write_manifest, into, manifest)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, into, True)
            raise
        return state

    async def _reattach(self) -> None:
        """After a checkpoint that failed: the machine runs on, talked to again (its processes
        follow it again on their own: `MachineProcess.output`). If it does not answer, the
        next call starts a new machine (`Machine.running`)."""
        channel = self._channel()
        try:
            await channel.reattach()
        except SandboxError as exc:
            log.warning("machine %s did not answer after a failed checkpoint: %s", self.id, exc)
            channel.not_detached()

    async def _teardown(self) -> None:
        try:
            await self._machine.destroy()
            await super()._teardown()
        finally:
            if self._uid_claimed:
                self._uid_claimed = False
                self._backend.release_uid(self._uid)


def _measured(saved: Path) -> SavedState:
    """What a whole save in `saved` holds, by its files (blocking: run it on a thread)."""
    workspace = saved / WORKSPACE_DIR
    return SavedState(
        machine=True,
        machine_bytes=tree_disk_bytes(saved / IMAGE_DIR),  # a machine's disks are sparse
        workspace_bytes=tree_bytes(workspace),
        files=sum(1 for p in workspace.rglob("*") if not p.is_dir()),
    )
