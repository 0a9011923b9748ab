"""The `gvisor` backend: each sandbox one gVisor machine driven by raw runsc, whole-machine
pause, snapshots and forks by gVisor's own checkpoint and restore (docs/gvisor.md).

A sandbox is a `KernelSandbox` like the local and Docker ones (kernels driven over ZeroMQ,
files in a host workspace bound in), but everything inside is reached through the machine's
agent (machine_agent.py), so that nothing inside holds a host socket and the machine can be
saved whole: every kernel with its variables, every process still running, the files.

Saved machines (machine_images.py) live under the state dir, read only from there:
- a paused one in `gvisor-paused/<handle>/`, restored by `wake`, removed once the service has
  the session recorded running (`woken`) or with its session;
- a named snapshot in the service's snapshot store, restored as often as asked by `fork`;
- a template per image and spec in `gvisor-templates/<key>/`: a machine with the preload's
  modules imported, made in the background after the first sandbox of its spec, from which
  the next ones are restored instead of started.
A machine restored from a save others are restored from too is re-keyed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Self

import docker
from docker.errors import DockerException
from pydantic import BaseModel, Field

from code_interpreter_wire.errors import BackendUnavailable, SandboxError
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.docker_launcher import write_user_database
from sandbox.backends.gvisor.agent_channel import AgentError
from sandbox.backends.gvisor.kernels import KeptKernel, MachineKernelLauncher
from sandbox.backends.gvisor.machine import (
    CGROUP_PARENT,
    ImageUnusable,
    Machine,
    MachineError,
    host_runsc_version,
    oci_config,
    runsc_program,
    unpack_rootfs,
    write_bundle,
)
from sandbox.backends.gvisor.machine_channels import (
    ChannelRouter,
    channel_environment,
    open_inside,
    read_only_dirs,
)
from sandbox.backends.gvisor.machine_images import (
    MANIFEST,
    read_manifest,
    saved_volume_places,
    template_key,
    volume_places,
)
from sandbox.backends.gvisor.machine_sandbox import IMAGE_DIR, WORKSPACE_DIR, GvisorSandbox
from sandbox.backends.gvisor.workspace_copy import copy_workspace
from sandbox.backends.kernel_recipe import ChannelPeer, KernelRecipe
from sandbox.image_labels import IMAGE_PATH, KERNEL_IMAGE
from sandbox.kernel.command import STARTUP_FILE_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.programs import KernelPrograms, image_programs, refuse_unbuilt_template
from sandbox.preload import ANALYST_PRELOAD
from sandbox.state_dir import SessionDirs, default_state_dir
from sandbox.uids import HostUidPool
from sandbox.workspace_files import Workspace

log = logging.getLogger(__name__)

TEMPLATE_RETRY_S = 600.0  # a template that failed is not made again sooner

__all__ = ["GvisorBackend", "GvisorBackendConfig", "GvisorSandbox", "why_unavailable"]


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the gvisor backend: runsc (as root) and the kernel image."""
    try:
        runsc_program()
    except BackendUnavailable as exc:
        return str(exc)
    return why_no_kernel_image(config.get("image"))


def why_no_kernel_image(image: str | None) -> str | None:
    """Why the kernel image machines are made from is not at hand (None: it is)."""
    try:
        with contextlib.closing(docker.from_env()) as client:
            client.images.get(image or KERNEL_IMAGE)
    except DockerException as exc:
        return f"the kernel image is not on a reachable Docker engine (`make image`): {exc}"
    return None


class GvisorBackendConfig(BaseModel):
    image: str = Field(KERNEL_IMAGE, description="Kernel image used when a spec names none.")
    state_dir: Path = Field(default_factory=default_state_dir)
    orchestrator_id: str = "default"
    python: str = "/opt/kernel/bin/python"
    kernel_path: str = IMAGE_PATH
    host_uid_base: int = Field(
        1_700_000, description="Sandbox i runs as host uid host_uid_base + i (never a real user)."
    )
    host_uid_count: int = 10_000
    templates: bool = Field(
        True,
        description="Restore new sandboxes from a template of their image and spec (made in "
        "the background after the first such sandbox, kept across restarts) instead of "
        "starting them.",
    )
    preload: str = Field(
        ANALYST_PRELOAD,
        description="Python a template runs, in a namespace of its own, before it is saved: "
        "the modules it imports are loaded in every sandbox restored from it.",
    )
    max_templates: int = Field(4, ge=1, description="Templates kept at once (one per spec).")
    root: bool = Field(
        True,
        description="Processes may run as the machine's root (sudo, `user: root`): gVisor is "
        "the wall, not their lack of rights. False: refused, as on the other backends.",
    )


class GvisorBackend(Backend):
    name = "gvisor"
    capabilities = BackendCapabilities(
        network_modes=("none", "allow_list", "any"),  # through the agent (machine_channels.py)
        host_tools=True,
        processes=True,
        suspend=True,  # the whole machine, by gVisor's checkpoint and restore
        snapshot=True,
        shared_across_nodes=False,
        images=True,
        runtimes=False,
        warm_pool=True,
        labels_sandboxes=False,
        host_dirs=True,
        ports=True,
        root=True,
        egress_files=True,
        mounts=True,  # bound by runsc's gofer, kept across a pause (the same places)
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
        self.templates_dir = self.config.state_dir / "gvisor-templates"
        self._programs: dict[str, tuple[KernelPrograms, Path]] = {}
        self._paused_uids: dict[str, int] = {}  # handle -> the uid its processes run as
        self._templates: dict[str, Path] = {}  # key -> a template found usable
        self._building: dict[str, asyncio.Task[Path]] = {}
        self._template_lock = asyncio.Lock()
        self._finishing: set[asyncio.Future[None]] = set()
        self._failed: dict[str, float] = {}  # key -> when its template last failed

    def finish_later(self, work: Awaitable[None]) -> None:
        """Run `work` (a saved machine's close) on its own, waited for by `close`."""
        task = asyncio.ensure_future(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
        task.add_done_callback(_log_failure)

    def hold_uid_for(self, handle: str, uid: int) -> None:
        """A paused machine's uid, whose claim its sandbox handed over, held for it."""
        self._paused_uids[handle] = uid

    def release_uid(self, uid: int) -> None:
        self.uids.release(uid)

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
                    refuse_unbuilt_template(image, labels)
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
        # A machine with a network holds the forwarder's TCP port, which this gVisor cannot
        # save: no template of it could be made. One with volumes holds their mounts: its
        # template would be of those volumes alone.
        if self.config.templates and not spec.network.enabled and not spec.mounts:
            template = await self._template(spec, image, rootfs)
            if template is not None:
                try:
                    return await self._restore(template, spec, shared=True)
                except SandboxError as exc:  # it does not restore, or not re-key: started
                    log.warning("template %s is unusable, dropped: %s", template.name, exc)
                    await self._drop_template(template)
        return await self._recipe(spec, image, kernels, rootfs).make()

    def _recipe(
        self, spec: SandboxSpec, image: str, kernels: KernelPrograms, rootfs: Path
    ) -> _MachineRecipe:
        return _MachineRecipe(self, spec, image, kernels, rootfs)

    async def machine_version(self) -> str:
        """What must be the same to restore a saved machine here: this host's runsc."""
        return await host_runsc_version()

    def _template_key(self, rootfs: Path, spec: SandboxSpec) -> str:
        return template_key(rootfs, spec, self.config.preload)

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        image = (spec.image if spec else None) or self.config.image
        return (await self._image(image))[0].languages

    # --- templates ---------------------------------------------------------------------------
    async def _template(self, spec: SandboxSpec, image: str, rootfs: Path) -> Path | None:
        """The ready template for `spec`, or None: one is then made in the background (if
        there is room for one more), for the sandboxes after this one."""
        key = self._template_key(rootfs, spec)
        found = self._templates.get(key)
        if found is not None:
            return found
        where = self.templates_dir / key
        if key not in self._building and (where / MANIFEST).is_file():  # kept from before
            try:
                read_manifest(where, await self.machine_version())
                self._templates[key] = where
                return where
            except ImageUnusable as exc:
                log.info("template %s is not reused: %s", key, exc)
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed < TEMPLATE_RETRY_S:
            return None  # made, or used, in vain lately: started, without trying again yet
        if key not in self._building and len(self._templates) + len(self._building) < (
            self.config.max_templates
        ):
            task = asyncio.ensure_future(self._make_template(key, spec, image))
            self._building[key] = task
            task.add_done_callback(_log_failure)
        return None

    async def prepare_templates(self, spec: SandboxSpec | None = None) -> Path:
        """Make (or find) the template sandboxes of `spec` are restored from, now."""
        spec = spec or SandboxSpec()
        image = spec.image or self.config.image
        _, rootfs = await self._image(image)
        key = self._template_key(rootfs, spec)
        self._failed.pop(key, None)  # asked for: tried again now
        found = await self._template(spec, image, rootfs)
        if found is not None:
            return found
        task = self._building.get(key)
        if task is None:
            raise SandboxError("no room for another template: raise max_templates")
        return await asyncio.shield(task)

    async def _make_template(self, key: str, spec: SandboxSpec, image: str) -> Path:
        try:
            async with self._template_lock:  # one at a time: each takes a machine's start
                # Made apart (another service on this state dir may make the same one), then
                # renamed into place: one found there meanwhile is the one kept.
                where = self.templates_dir / key
                making = self.templates_dir / f".{key}.{secrets.token_hex(4)}.new"
                try:  # made meanwhile by another service on this state dir
                    await asyncio.to_thread(read_manifest, where, await self.machine_version())
                    self._templates[key] = where
                    return where
                except ImageUnusable:
                    await asyncio.to_thread(shutil.rmtree, where, True)
                kernels, rootfs = await self._image(image)
                sandbox = await self._recipe(spec, image, kernels, rootfs).make()
                try:
                    if self.config.preload:
                        await sandbox.preload(self.config.preload)
                    saved = await sandbox.save_and_stop(making)
                finally:  # a template holds no uid: see _MachineRecipe
                    self.finish_later(sandbox.close())
                if not saved:
                    raise SandboxError("the template's machine could not be saved")
                try:
                    os.rename(making, where)
                except OSError:  # made by another meanwhile: theirs is as good
                    await asyncio.to_thread(shutil.rmtree, making, True)
                self._templates[key] = where
                self._failed.pop(key, None)
                log.info("template %s made for the sandboxes of its spec", key)
                return where
        except Exception:
            self._failed[key] = time.monotonic()
            raise
        finally:
            self._building.pop(key, None)

    async def _drop_template(self, where: Path) -> None:
        self._templates.pop(where.name, None)
        self._failed[where.name] = time.monotonic()
        await asyncio.to_thread(shutil.rmtree, where, True)

    # --- saved machines -----------------------------------------------------------------------
    async def _restore(self, saved: Path, spec: SandboxSpec, *, shared: bool) -> GvisorSandbox:
        """A sandbox restored from the saved machine in `saved`; `shared`: others are restored
        from it too, so it is re-keyed."""
        manifest = await asyncio.to_thread(read_manifest, saved, await self.machine_version())
        for holds, asked, what in (
            (manifest.get("host_tools", False), spec.host_tools, "host tools"),
            (manifest.get("network", False), spec.network.enabled, "a network"),
        ):
            if bool(holds) != asked:  # its mounts and listeners are the machine's own
                had = "had" if holds else "had no"
                raise ImageUnusable(
                    f"the saved machine {had} {what}; a sandbox restored from it must too"
                )
        held = saved_volume_places(manifest)  # checked by read_manifest
        if held != volume_places(spec):  # the restored mount table is the saved one
            listed = ", ".join(f"{p} ({'ro' if ro else 'rw'})" for p, ro in held) or "none"
            raise ImageUnusable(
                f"the saved machine had volumes mounted at {listed}; a sandbox restored from it "
                "must mount volumes at those places, as they were"
            )
        image = str(manifest["image"])
        kernels, rootfs = await self._image(image)
        recipe = self._recipe(spec, image, kernels, rootfs)
        recipe.restoring = (saved, manifest)
        recipe.rekey = shared
        return await recipe.make()

    async def wake(self, handle: str, spec: SandboxSpec) -> GvisorSandbox:
        paused = self._paused(handle)
        uid = self._give_back_uid(handle)  # claimed again by the machine that wakes
        try:
            sandbox = await self._restore(paused, spec, shared=False)
        except BaseException:
            if uid is not None:
                self.keep_uid(handle, uid)  # still paused: still its
            raise
        return sandbox  # its image stays until the service has it recorded running (`woken`)

    async def woken(self, handle: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self._paused(handle), True)

    async def fork(self, saved: Path, spec: SandboxSpec) -> GvisorSandbox:
        return await self._restore(saved, spec, shared=True)

    async def take_suspended(self, handle: str, into: Path) -> None:
        paused = self._paused(handle)
        await asyncio.to_thread(os.rename, paused, into)
        self._give_back_uid(handle)  # whoever wakes it claims its uid again

    async def wake_from(self, saved: Path, spec: SandboxSpec) -> GvisorSandbox:
        return await self._restore(saved, spec, shared=False)

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
        program = runsc_program()
        # Their machines first, if they still run: then nothing writes in their directories.
        for found in await asyncio.to_thread(SessionDirs.orphans, self.config.state_dir, self.name):
            with contextlib.suppress(MachineError):
                await Machine(program, self.runsc_root, found.name, self.runsc_root).destroy()
        return len(
            await asyncio.to_thread(SessionDirs.remove_orphans, self.config.state_dir, self.name)
        )

    async def close(self) -> None:
        for building in list(self._building.values()):
            building.cancel()
        while self._building or self._finishing:  # a build given up closes its machine too
            await asyncio.gather(*self._building.values(), *self._finishing, return_exceptions=True)


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("a machine's work in the background failed: %s", task.exception())


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
        self.rekey = False  # restored from a save others are restored from too
        self.uid_claimed = False
        self.kept: dict[str, KeptKernel] = {}
        self.kept_processes: list[dict[str, Any]] = []
        # Each language's launcher, as its driver is made: the sandbox saves their kernels.
        self.launchers: dict[str, MachineKernelLauncher] = {}
        self.router = ChannelRouter()

    async def make_dirs(self) -> SessionDirs:
        if self.restoring is not None:
            # Its processes run as the uid they were saved with, which forks of one snapshot
            # or template share: claimed when free, shared if not. In gVisor that uid is the
            # sentry's, not a host process's (no host quota is counted on it), and each
            # machine's gofer serves its own workspace alone (docs/gvisor.md).
            self.uid = int(self.restoring[1]["uid"])
            self.uid_claimed = self.backend.uids.claim(self.uid)
        else:
            self.uid = self.backend.uids.allocate()
            self.uid_claimed = True
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
        self.make_channels(dirs)  # bound into the machine: made before it starts
        self.router.host_channel, self.router.egress_channel = (
            self.host_channel,
            self.egress_channel,
        )
        program = runsc_program()
        self.backend.runsc_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        bundle = dirs.root / "bundle"
        config = oci_config(
            rootfs=self.rootfs,
            dirs_etc=dirs.etc,
            workspace=dirs.workspace,
            limits=self.spec.limits,
            cgroup=f"{CGROUP_PARENT}/{self.sandbox_id}",
            read_only=read_only_dirs(self.host_channel, self.egress_channel),
            volumes=self.spec.mounts,
        )
        config["process"]["cwd"] = "/"
        write_bundle(bundle, config)
        self.machine = Machine(
            program,
            self.backend.runsc_root,
            self.sandbox_id,
            bundle,
            root_allowed=self.backend.config.root,
        )
        image = None
        if self.restoring is not None:
            saved, manifest = self.restoring
            await asyncio.to_thread(copy_workspace, saved / WORKSPACE_DIR, dirs.workspace)
            image = saved / IMAGE_DIR
            self.kept = {k: KeptKernel.from_json(v) for k, v in manifest["kernels"].items()}
            self.kept_processes = list(manifest.get("processes") or [])
        try:
            channel = await self.machine.start(self.router.accept, image=image)
            await channel.hello()
        except (MachineError, AgentError) as exc:
            if image is not None:
                raise ImageUnusable(f"the saved machine could not be restored: {exc}") from None
            raise
        if image is None:  # a restored machine has its listeners and forwarder already
            await open_inside(channel, self.spec, self.kernels.python, self.uid)

    def channel_peer(self) -> ChannelPeer:
        # The host's channel sockets are reached by this service alone, for the agent inside
        # (machine_channels.py): no process of the machine can connect to a host socket. The
        # directories are the sandbox's group's to read (the tools' module and manifest).
        assert self.uid is not None
        return ChannelPeer(os.geteuid(), self.uid)

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
            environment=lambda: channel_environment(self.spec),
            hit_memory_limit=self.machine.hit_memory_limit,
            kept=self.kept.pop(language, None),
        )

    def driver(self, language: str) -> KernelDriver:
        launcher = self.launcher(language)
        self.launchers[language] = launcher
        return KernelDriver.for_spec(launcher, self.spec, language)

    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> GvisorSandbox:
        assert self.machine is not None and self.uid is not None
        uid = self.uid
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
            uid_claimed=self.uid_claimed,
            kernel_path=self.backend.config.kernel_path,
            root=self.backend.config.root,
        )
        self.uid_claimed = False  # the sandbox's to give back now
        return sandbox

    async def start_kept_kernels(self, sandbox: GvisorSandbox) -> None:
        """The other languages' kernels the machine ran when saved, taken over now."""
        for language in list(self.kept):
            await sandbox._driver_for(language)

    async def undo(self) -> None:
        if self.machine is not None:
            await self.machine.destroy()
        if self.uid is not None and self.uid_claimed:
            self.backend.uids.release(self.uid)

    async def make(self) -> GvisorSandbox:
        sandbox = await super().make()
        try:
            await self.start_kept_kernels(sandbox)
            await sandbox.adopt_processes(self.kept_processes)
            if self.rekey:
                await sandbox.rekey()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox
