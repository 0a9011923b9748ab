"""The `gvisor` backend: each sandbox one gVisor machine driven by raw runsc, whole-machine
pause and resume by gVisor's own checkpoint and restore (docs/gvisor.md).

A sandbox is a `KernelSandbox` like the local and Docker ones (kernels driven over ZeroMQ,
files in a host workspace bound in), but everything inside is reached through the machine's
agent (machine_agent.py), so that nothing inside holds a host socket and the machine can be
saved whole: every kernel with its variables, every process still running, the files.

A paused machine lives in `<state dir>/gvisor-paused/<handle>/`: the checkpoint image, a copy of
the workspace, and a manifest (image, uid, kernels, processes). It is read only from there,
survives a restart of the service, and is removed when its session is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import docker
from docker.errors import DockerException
from pydantic import BaseModel, Field

from code_interpreter_wire.errors import BackendUnavailable, SandboxError, StateNotSaved
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.docker_launcher import write_user_database
from sandbox.backends.gvisor.agent_channel import AgentChannel, AgentError, ChannelStream
from sandbox.backends.gvisor.kernels import KeptKernel, MachineKernelLauncher
from sandbox.backends.gvisor.machine import (
    CGROUP_PARENT,
    ImageUnusable,
    Machine,
    MachineError,
    oci_config,
    runsc_program,
    unpack_rootfs,
    write_bundle,
)
from sandbox.backends.gvisor.processes import MachineSpawner
from sandbox.backends.gvisor.workspace_copy import copy_workspace
from sandbox.backends.kernel_recipe import ChannelPeer, KernelRecipe
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.image_labels import KERNEL_IMAGE
from sandbox.kernel.command import STARTUP_FILE_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.programs import KernelPrograms, image_programs
from sandbox.state_dir import SessionDirs, default_state_dir
from sandbox.uids import HostUidPool
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the gvisor backend: runsc (as root) and the kernel image."""
    try:
        runsc_program()
        with contextlib.closing(docker.from_env()) as client:
            client.images.get(config.get("image") or KERNEL_IMAGE)
    except BackendUnavailable as exc:
        return str(exc)
    except DockerException as exc:
        return f"the kernel image is not on a reachable Docker engine (`make image`): {exc}"
    return None


class GvisorBackendConfig(BaseModel):
    image: str = Field(KERNEL_IMAGE, description="Kernel image used when a spec names none.")
    state_dir: Path = Field(default_factory=default_state_dir)
    orchestrator_id: str = "default"
    python: str = "/opt/kernel/bin/python"
    kernel_path: str = "/opt/kernel/bin:/usr/local/bin:/usr/bin:/bin"
    host_uid_base: int = Field(
        1_700_000, description="Sandbox i runs as host uid host_uid_base + i (never a real user)."
    )
    host_uid_count: int = 10_000


class GvisorBackend(Backend):
    name = "gvisor"
    capabilities = BackendCapabilities(
        network_modes=("none",),
        host_tools=False,
        processes=True,
        suspend=True,  # the whole machine, by gVisor's checkpoint and restore
        snapshot=True,
        shared_across_nodes=False,
        images=True,
        runtimes=False,
        warm_pool=True,
        labels_sandboxes=False,
        host_dirs=True,
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(GvisorBackendConfig(**config))

    def __init__(self, config: GvisorBackendConfig | None = None) -> None:
        self.config = config or GvisorBackendConfig()
        self.uids = HostUidPool(self.config.host_uid_base, self.config.host_uid_count)
        self.runsc_root = self.config.state_dir / "gvisor-runsc"
        self.rootfs_store = self.config.state_dir / "gvisor-rootfs"
        self.paused_dir = self.config.state_dir / "gvisor-paused"
        self._programs: dict[str, tuple[KernelPrograms, Path]] = {}
        self._paused_uids: dict[str, int] = {}  # handle -> the uid its processes run as

    def keep_uid(self, handle: str, uid: int) -> None:
        """Hold a paused machine's uid for it (its processes run as it), in this process."""
        if handle not in self._paused_uids and self.uids.claim(uid):
            self._paused_uids[handle] = uid

    def _give_back_uid(self, handle: str) -> int | None:
        uid = self._paused_uids.pop(handle, None)
        if uid is not None:
            self.uids.release(uid)
        return uid

    async def _image(self, image: str) -> tuple[KernelPrograms, Path]:
        """The image's kernels and its unpacked root filesystem (made once)."""
        if image not in self._programs:

            def find() -> tuple[KernelPrograms, Path]:
                with contextlib.closing(docker.from_env()) as client:
                    labels = client.images.get(image).labels
                    rootfs = unpack_rootfs(client, image, self.rootfs_store)
                return image_programs(labels, self.config.python, STARTUP_FILE_IN_SANDBOX), rootfs

            try:
                self._programs[image] = await asyncio.to_thread(find)
            except DockerException as exc:
                raise BackendUnavailable(f"the kernel image {image!r}: {exc}") from None
        return self._programs[image]

    async def create(self, spec: SandboxSpec | None = None) -> GvisorSandbox:
        spec = spec or SandboxSpec()
        self.refuse_runtime(spec)
        image = spec.image or self.config.image
        kernels, rootfs = await self._image(image)
        return await _MachineRecipe(self, spec, image, kernels, rootfs).make()

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        image = (spec.image if spec else None) or self.config.image
        return (await self._image(image))[0].languages

    async def wake(self, handle: str, spec: SandboxSpec) -> GvisorSandbox:
        paused = self._paused(handle)
        try:
            manifest = json.loads((paused / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise ImageUnusable(
                f"the paused machine {handle} has no readable manifest: {exc}"
            ) from None
        if manifest.get("version") != MANIFEST_VERSION:
            raise ImageUnusable(f"the paused machine {handle} was saved by another version")
        if manifest.get("runsc") != await _version():
            raise ImageUnusable(
                f"the paused machine {handle} was saved by gVisor {manifest.get('runsc')}, "
                f"this host runs {await _version()}"
            )
        kernels, rootfs = await self._image(str(manifest["image"]))
        self._give_back_uid(handle)  # claimed again by the machine that wakes
        recipe = _MachineRecipe(self, spec, str(manifest["image"]), kernels, rootfs)
        recipe.restoring = (paused, manifest)
        try:
            sandbox = await recipe.make()
        except BaseException:
            self.keep_uid(handle, int(manifest["uid"]))  # still paused: still its
            raise
        shutil.rmtree(paused, ignore_errors=True)  # running again: the image is spent
        return sandbox

    async def discard(self, handle: str) -> None:
        self._give_back_uid(self._paused(handle).name)
        await asyncio.to_thread(shutil.rmtree, self._paused(handle), True)

    def _paused(self, handle: str) -> Path:
        if not handle.isalnum() or len(handle) > 64:
            raise SandboxError(f"{handle!r} does not name a paused machine")
        return self.paused_dir / handle

    async def cleanup_orphans(self) -> int:
        # The uids of machines paused before this process started are theirs again.
        if self.paused_dir.is_dir():
            for paused in self.paused_dir.iterdir():
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    uid = int(json.loads((paused / MANIFEST).read_text())["uid"])
                    self.keep_uid(paused.name, uid)
        dirs = await asyncio.to_thread(SessionDirs.remove_orphans, self.config.state_dir, self.name)
        program = runsc_program()
        for sandbox_id in dirs:  # its machine, if it still runs
            with contextlib.suppress(MachineError):
                await Machine(program, self.runsc_root, sandbox_id, self.runsc_root).destroy()
        return len(dirs)


async def _version() -> str:
    from sandbox.backends.gvisor.machine import runsc_version

    return await runsc_version(runsc_program())


class _MachineRecipe(KernelRecipe["GvisorSandbox"]):
    """A machine's steps of the recipe: a host uid, the machine started (or restored) with its
    agent answering, then Python's kernel through it."""

    def __init__(
        self,
        backend: GvisorBackend,
        spec: SandboxSpec,
        image: str,
        kernels: KernelPrograms,
        rootfs: Path,
    ) -> None:
        super().__init__(spec)
        self.backend = backend
        self.image = image
        self.kernels = kernels
        self.rootfs = rootfs
        self.uid: int | None = None
        self.dirs: SessionDirs | None = None
        self.machine: Machine | None = None
        self.restoring: tuple[Path, dict[str, Any]] | None = None
        self.kept: dict[str, KeptKernel] = {}
        self.kept_processes: list[dict[str, Any]] = []
        # Each language's launcher, as its driver is made: the sandbox saves their kernels.
        self.launchers: dict[str, MachineKernelLauncher] = {}

    async def make_dirs(self) -> SessionDirs:
        if self.restoring is not None:
            uid = int(self.restoring[1]["uid"])
            if not self.backend.uids.claim(uid):
                raise SandboxError(f"the uid {uid} of the paused machine is in use")
            self.uid = uid
        else:
            self.uid = self.backend.uids.allocate()
        self.dirs = await asyncio.to_thread(
            SessionDirs.create,
            self.backend.config.state_dir,
            self.backend.name,
            self.sandbox_id,
            workspace_size_mb=self.spec.limits.workspace_size_mb,
            owner=(self.uid, self.uid),
            root_mode=0o700,
        )
        return self.dirs

    async def prepare(self, dirs: SessionDirs) -> None:
        assert self.uid is not None
        write_user_database(dirs, self.uid)
        program = runsc_program()
        self.backend.runsc_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        bundle = dirs.root / "bundle"
        config = oci_config(
            rootfs=self.rootfs,
            dirs_etc=dirs.etc,
            workspace=dirs.workspace,
            limits=self.spec.limits,
            cgroup=f"{CGROUP_PARENT}/{self.sandbox_id}",
        )
        config["process"]["cwd"] = "/"
        write_bundle(bundle, config)
        self.machine = Machine(program, self.backend.runsc_root, self.sandbox_id, bundle)
        image = None
        if self.restoring is not None:
            paused, manifest = self.restoring
            await asyncio.to_thread(copy_workspace, paused / "workspace", dirs.workspace)
            image = paused / "image"
            self.kept = {k: KeptKernel.from_json(v) for k, v in manifest["kernels"].items()}
            self.kept_processes = list(manifest.get("processes") or [])
        try:
            channel = await self.machine.start(_refuse_accept, image=image)
            await channel.hello()
        except MachineError as exc:
            if image is not None:
                raise ImageUnusable(f"the paused machine could not be restored: {exc}") from None
            raise

    def wants_egress(self) -> bool:
        return False

    def channel_peer(self) -> ChannelPeer:
        assert self.uid is not None
        return ChannelPeer(self.uid, self.uid)

    def launcher(self, language: str) -> MachineKernelLauncher:
        assert self.dirs is not None and self.uid is not None
        assert self.machine is not None
        return MachineKernelLauncher(
            self.machine.running,
            self.spec,
            self.dirs.kernel_of(language),
            language,
            self.kernels,
            self.uid,
            kernel_path=self.backend.config.kernel_path,
            environment=lambda: dict(self.spec.env),
            hit_memory_limit=self.machine.hit_memory_limit,
            kept=self.kept.pop(language, None),
        )

    def driver(self, language: str) -> KernelDriver:
        launcher = self.launcher(language)
        self.launchers[language] = launcher
        return KernelDriver.for_spec(launcher, self.spec, language)

    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> GvisorSandbox:
        assert self.machine is not None and self.uid is not None
        uids, uid = self.backend.uids, self.uid
        sandbox = GvisorSandbox(
            self.sandbox_id,
            self.spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace), owner=(uid, uid)),
            languages=self.kernels.languages,
            make_driver=self.driver,
            backend=self.backend,
            machine=self.machine,
            image=self.image,
            uid=uid,
            launchers=self.launchers,
            on_close=lambda: uids.release(uid),
        )
        return sandbox

    async def start_kept_kernels(self, sandbox: GvisorSandbox) -> None:
        """The other languages' kernels the machine ran when saved, taken over now."""
        for language in list(self.kept):
            await sandbox._driver_for(language)

    async def undo(self) -> None:
        if self.machine is not None:
            await self.machine.destroy()
        if self.uid is not None:
            self.backend.uids.release(self.uid)

    async def make(self) -> GvisorSandbox:
        sandbox = await super().make()
        try:
            await self.start_kept_kernels(sandbox)
            await sandbox.adopt_processes(self.kept_processes)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox


async def _refuse_accept(channel: str, stream: ChannelStream) -> None:
    stream.close()  # no channel listens inside yet (host tools, egress)


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
        backend: GvisorBackend,
        machine: Machine,
        image: str,
        uid: int,
        launchers: dict[str, MachineKernelLauncher],
        on_close: Callable[[], None],
    ) -> None:
        super().__init__(sandbox_id, spec, driver, dirs, workspace, languages, make_driver)
        self._backend = backend
        self._machine = machine
        self._image = image
        self._uid = uid
        self._launchers = launchers
        self._on_close = on_close

    def _channel(self) -> AgentChannel:
        channel = self._machine.channel
        if channel is None:
            raise SandboxError("the sandbox's machine is not running")
        return channel

    def spawner(self) -> MachineSpawner:
        return MachineSpawner(self._machine.running, self._uid, lambda: dict(self.spec.env))

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

    async def suspend(self) -> str | None:
        """Save the whole machine (kernels, processes, memory, files) and stop it. None where
        its gVisor cannot save what it holds (a network socket): the caller then saves the
        kernels' state instead, and the machine runs on until then."""
        if self.is_busy:
            raise SandboxError("the sandbox is running code; pause it once the code ends")
        channel = await self._machine.running()
        reasons = await channel.unsaveable()
        if reasons:
            log.info("machine %s cannot be saved whole (%s)", self.id, "; ".join(reasons))
            return None
        handle = secrets.token_hex(12)
        paused = self._backend.paused_dir / handle
        paused.mkdir(mode=0o700, parents=True)
        kernels = {
            language: launcher.current.kept.as_json()
            for language, launcher in self._launchers.items()
            if launcher.current is not None and language in self.started_languages
        }
        running = self._processes.running() if self._processes is not None else []
        processes = [{"pid": p.pid, "request": p.request.model_dump(mode="json")} for p in running]
        try:
            await self._machine.checkpoint(paused / "image")
        except MachineError as exc:
            shutil.rmtree(paused, ignore_errors=True)
            log.warning("machine %s could not be saved whole: %s", self.id, exc)
            await self._reattach()
            return None
        except BaseException:
            shutil.rmtree(paused, ignore_errors=True)
            raise
        try:  # nothing runs in it now: its workspace is still
            (paused / "workspace").mkdir(mode=0o700)
            await asyncio.to_thread(copy_workspace, self.dirs.workspace, paused / "workspace")
            manifest = {
                "version": MANIFEST_VERSION,
                "runsc": await _version(),
                "image": self._image,
                "uid": self._uid,
                "kernels": kernels,
                "processes": processes,
            }
            (paused / MANIFEST).write_text(json.dumps(manifest))
        except BaseException as exc:
            shutil.rmtree(paused, ignore_errors=True)
            await self.close()
            raise StateNotSaved(
                f"the machine was saved, its workspace could not be: {exc}"
            ) from exc
        self._backend.keep_uid(handle, self._uid)  # its processes run as it: kept for them
        await self.close()
        return handle

    async def _reattach(self) -> None:
        """After a checkpoint that failed: the machine runs on, talked to again, each process
        followed anew (without its output again). If it does not answer, the next call
        starts a new machine (`Machine.running`)."""
        channel = self._channel()
        try:
            await channel.reattach()
        except SandboxError as exc:
            log.warning("machine %s did not answer after a failed checkpoint: %s", self.id, exc)
            channel.not_detached()
            return
        if self._processes is None:
            return
        spawner = self.spawner()
        for process in self._processes.running():
            terminal = process.request.terminal is not None
            spawned = await spawner.adopt(process.pid, terminal=terminal, replay=False)
            self._processes.adopt(spawned, process.request)

    async def _teardown(self) -> None:
        try:
            await self._machine.destroy()
            await super()._teardown()
        finally:
            self._on_close()
