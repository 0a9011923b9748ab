"""The `microvm` backend: each sandbox a QEMU virtual machine with a Linux kernel of its own
(docs/microvm.md).

The machine runs what a gVisor machine runs, the same way: our agent as its first process, the
kernels, commands and terminals its children, everything reached over the agent's one channel
(sandbox/backends/gvisor/: the sandbox, its kernels and processes are that backend's code, the
machine under them is QEMU's here). What differs is the wall: a guest kernel on KVM where this
host has it, on QEMU's emulated CPU (TCG) where not, with QEMU itself confined (qemu.py); and
the disks (guest_disks.py), the workspace one of them, its files reached through the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Literal, Self

import docker
from docker.errors import DockerException
from pydantic import Field

from code_interpreter_wire.errors import BackendUnavailable
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import BackendCapabilities
from sandbox.backends.docker_launcher import write_user_database
from sandbox.backends.gvisor.agent_channel import AgentChannel, AgentError
from sandbox.backends.gvisor.backend import (
    GvisorBackend,
    GvisorBackendConfig,
    _MachineRecipe,
    why_no_kernel_image,
)
from sandbox.backends.gvisor.kernels import KeptKernel
from sandbox.backends.gvisor.machine import ImageUnusable
from sandbox.backends.gvisor.machine_channels import open_inside
from sandbox.backends.gvisor.machine_images import template_key
from sandbox.backends.gvisor.machine_sandbox import IMAGE_DIR
from sandbox.backends.kernel_recipe import ChannelPeer
from sandbox.backends.microvm import guest_boot, guest_disks, guest_kernel
from sandbox.backends.microvm.guest_channels import channel_files, mirror_into, push_file
from sandbox.backends.microvm.machine import MachineError, QemuMachine
from sandbox.backends.microvm.qemu import (
    Accelerator,
    MachineLayout,
    accelerator,
    qemu_program,
    qemu_version,
)
from sandbox.backends.microvm.sandbox import MicrovmSandbox
from sandbox.cgroups import remove_groups_of
from sandbox.host_channel import MANIFEST_NAME, MODULE_NAME
from sandbox.kernel.command import STARTUP_FILE_IN_SANDBOX
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.programs import KernelPrograms, image_programs, refuse_unbuilt_template
from sandbox.state_dir import SessionDirs
from sandbox.workspace_files import Workspace

__all__ = ["MicrovmBackend", "MicrovmBackendConfig", "MicrovmSandbox", "why_unavailable"]

GUEST_UID = 1000  # the sandbox's user inside every machine
LAYER_DISK, WORKSPACE_DISK = "layer.ext4", "workspace.ext4"
GUEST_RESERVE_MB = 160  # the guest kernel's and the agent's own memory, beside the sandbox's
ROOT_LAYER_MB = 4096  # a sparse file: what a machine's root may take (packages it installs)
WORKSPACE_SLACK_PERCENT = 8  # ext4's own metadata, so the sandbox gets its whole quota


def why_unavailable(**config: Any) -> str | None:
    """What this host lacks for the microvm backend: QEMU (as root), a static busybox,
    mkfs.ext4, the fetched guest kernel, and the kernel image on a Docker engine."""
    try:
        qemu_program()
        guest_boot.busybox_program()
        guest_disks.mkfs_program()
        guest_kernel.find(Path(config["kernel_dir"]) if config.get("kernel_dir") else None)
    except BackendUnavailable as exc:
        return str(exc)
    return why_no_kernel_image(config.get("image"))


class MicrovmBackendConfig(GvisorBackendConfig):
    """The gVisor machines' settings (the same sandbox code reads them), and QEMU's."""

    host_uid_base: int = Field(
        1_800_000,
        description="Machine i's QEMU runs as host uid host_uid_base + i (never a real user).",
    )
    root: bool = Field(
        True,
        description="Processes may run as the machine's root (sudo, `user: root`): the "
        "machine is the wall. False: refused, as on the other backends.",
    )
    kernel_dir: Path | None = Field(
        None, description="Where the guest kernel was fetched (default: the user's cache)."
    )
    rootfs_dir: Path | None = Field(
        None,
        description="Where the images' root filesystem disks are kept (made once per image id, "
        "shared by every service of this user: default, the user's cache).",
    )
    machine: Literal["auto", "q35", "microvm"] = Field(
        "auto",
        description="QEMU's machine type: `auto` (microvm on KVM, q35 on TCG), or either.",
    )
    hang_timeout_s: float = Field(
        90.0,
        gt=0,
        description="A machine whose agent answers nothing this long (its kernel hung) is "
        "ended; the session goes on in a fresh machine.",
    )
    accelerator: Literal["auto", "kvm", "tcg"] = Field(
        "auto", description="`auto` (KVM where it runs guests, else TCG), `kvm` or `tcg`."
    )


class MicrovmBackend(GvisorBackend):
    name = "microvm"
    capabilities = BackendCapabilities(
        network_modes=("none", "allow_list", "any"),  # through the agent, as gVisor machines
        host_tools=True,
        processes=True,
        suspend=True,  # the whole machine, by QEMU's migration into a file
        snapshot=True,
        shared_across_nodes=False,
        images=True,
        runtimes=False,
        warm_pool=True,
        labels_sandboxes=False,
        host_dirs=True,
        ports=False,
        root=True,
        workspace_on_host=False,  # a disk of the machine's
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(MicrovmBackendConfig(**config))

    def __init__(self, config: MicrovmBackendConfig | None = None) -> None:
        self.vm_config = config or MicrovmBackendConfig()
        super().__init__(self.vm_config)
        c = self.vm_config
        self.rootfs_store = c.rootfs_dir or guest_kernel.default_dir().with_name("microvm-rootfs")
        self.paused_dir = c.state_dir / "microvm-paused"
        self.templates_dir = c.state_dir / "microvm-templates"
        self._kernel: guest_kernel.GuestKernel | None = None
        self._initramfs: Path | None = None

    async def guest(self) -> tuple[guest_kernel.GuestKernel, Path, Accelerator]:
        """The guest kernel, its initramfs and the accelerator machines run on here."""
        if self._kernel is None or self._initramfs is None:
            kernel = await asyncio.to_thread(guest_kernel.find, self.vm_config.kernel_dir)
            self._initramfs = await asyncio.to_thread(guest_boot.initramfs, kernel)
            self._kernel = kernel
        chosen = self.vm_config.accelerator
        if chosen == "tcg":
            accel = Accelerator("tcg", "q35", "the operator chose TCG")
        elif chosen == "kvm":
            accel = Accelerator("kvm", "microvm", "the operator chose KVM")
        else:
            accel = await accelerator(self._kernel)
        if self.vm_config.machine != "auto":
            accel = dataclasses.replace(accel, machine=self.vm_config.machine)
        return self._kernel, self._initramfs, accel

    async def _image(self, image: str) -> tuple[KernelPrograms, Path]:
        """The image's kernels and its root filesystem disk (made once per image id); the
        guest's kernel found first (what a template's key holds)."""
        await self.guest()
        if image not in self._programs:

            def find() -> tuple[KernelPrograms, Path]:
                with contextlib.closing(docker.from_env()) as client:
                    labels = client.images.get(image).labels
                    refuse_unbuilt_template(image, labels)
                    rootfs = guest_disks.root_filesystem(client, image, self.rootfs_store)
                return image_programs(
                    labels, self.vm_config.python, STARTUP_FILE_IN_SANDBOX
                ), rootfs

            try:
                self._programs[image] = await asyncio.to_thread(find)
            except DockerException as exc:
                raise BackendUnavailable(f"the kernel image {image!r}: {exc}") from None
        return self._programs[image]

    async def create(self, spec: SandboxSpec | None = None) -> MicrovmSandbox:
        sandbox = await super().create(spec)
        assert isinstance(sandbox, MicrovmSandbox)
        return sandbox

    def _recipe(
        self, spec: SandboxSpec, image: str, kernels: KernelPrograms, rootfs: Path
    ) -> _MachineRecipe:
        return _VmRecipe(self, spec, image, kernels, rootfs)

    async def machine_version(self) -> str:
        """What must be the same to restore a saved machine here: QEMU's version, and the
        accelerator and machine type (a save holds their devices' state)."""
        _, _, accel = await self.guest()
        return f"{await qemu_version()}; {accel.name}; {accel.machine}"

    def _template_key(self, rootfs: Path, spec: SandboxSpec) -> str:
        assert self._kernel is not None and self._initramfs is not None
        machine = f"{self._kernel.release}/{self._initramfs.name}"
        return template_key(rootfs, spec, f"{machine}\0{self.vm_config.preload}")

    async def cleanup_orphans(self) -> int:
        orphans = await asyncio.to_thread(SessionDirs.orphans, self.vm_config.state_dir, self.name)
        for found in orphans:  # their QEMU, if it still runs: nothing then writes their disks
            await asyncio.to_thread(_kill_qemu_of, found)
        await asyncio.to_thread(remove_groups_of, [f"vm-{found.name}" for found in orphans])
        return len(
            await asyncio.to_thread(SessionDirs.remove_orphans, self.vm_config.state_dir, self.name)
        )


def _kill_qemu_of(session: Path) -> None:
    """Kill the QEMU whose agent socket is in `session` (a process that died left it)."""
    sock = str(session / "machine" / "agent.sock")
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and argv[0].endswith(b"qemu-system-x86_64")
            and any(sock.encode() in arg for arg in argv)
        ):
            with contextlib.suppress(OSError):
                os.kill(int(pid_dir.name), 9)


class _VmRecipe(_MachineRecipe):
    """A machine's steps of the recipe, its machine QEMU's: a host uid for QEMU, the disks
    made (or copied from a save), the guest booted (or restored) with its agent answering,
    then Python's kernel through it."""

    backend: MicrovmBackend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qemu_uid: int | None = None

    async def make_dirs(self) -> SessionDirs:
        # QEMU runs as a host uid of its own; inside, the sandbox's user is GUEST_UID in every
        # machine (a restored one keeps its files' owner). The workspace is a disk of the
        # machine's, its quota its size: no host tmpfs for it.
        self.qemu_uid = self.backend.uids.allocate()
        self.uid = GUEST_UID
        self.uid_claimed = False
        self.dirs = await asyncio.to_thread(
            SessionDirs.create,
            self.backend.vm_config.state_dir,
            self.backend.name,
            self.sandbox_id,
            root_mode=0o700,
        )
        return self.dirs

    async def prepare(self, dirs: SessionDirs) -> None:
        assert self.uid is not None and self.qemu_uid is not None
        backend = self.backend
        write_user_database(dirs, self.uid)
        self.make_channels(dirs)  # their files go into the machine: made before it starts
        self.router.host_channel, self.router.egress_channel = (
            self.host_channel,
            self.egress_channel,
        )
        extra = {} if self.host_channel is None else channel_files(self.host_channel)
        kernel, initramfs, accel = await backend.guest()
        limits = self.spec.limits
        where = dirs.root / "machine"
        await asyncio.to_thread(where.mkdir, mode=0o700)
        layer, workspace = where / LAYER_DISK, where / WORKSPACE_DISK
        image = None
        if self.restoring is None:
            workspace_mb = limits.workspace_size_mb * (100 + WORKSPACE_SLACK_PERCENT) // 100
            await asyncio.gather(
                asyncio.to_thread(
                    guest_disks.make_root_layer, layer, ROOT_LAYER_MB, dirs.etc, extra
                ),
                asyncio.to_thread(
                    guest_disks.make_workspace, workspace, workspace_mb, (self.uid, self.uid)
                ),
            )
        else:
            saved, manifest = self.restoring
            image = saved / IMAGE_DIR
            self.kept = {k: KeptKernel.from_json(v) for k, v in manifest["kernels"].items()}
            self.kept_processes = list(manifest.get("processes") or [])
        layout = MachineLayout(
            kernel=kernel,
            initramfs=initramfs,
            rootfs=self.rootfs,
            root_layer=layer,
            workspace=workspace,
            agent_socket=where / "agent.sock",
            monitor_socket=where / "monitor.sock",
            chroot=where / "empty",
            memory_mb=limits.memory_mb + GUEST_RESERVE_MB,
            cpus=max(1, math.ceil(limits.cpus)),
            tmp_mb=limits.tmp_size_mb,
            pids=limits.pids,
            open_files=limits.open_files,
            file_size_mb=limits.file_size_mb,
            uid=self.qemu_uid,
            gid=self.qemu_uid,
        )
        machine = QemuMachine(
            qemu_program(),
            accel,
            layout,
            limits,
            self.sandbox_id,
            root_allowed=backend.config.root,
            hang_timeout_s=backend.vm_config.hang_timeout_s,
        )
        qemu_uid, self.qemu_uid = self.qemu_uid, None  # the machine's to give back now
        machine.on_destroyed = lambda: backend.uids.release(qemu_uid)
        self.machine = machine  # type: ignore[assignment]
        if self.host_channel is not None:  # the manifest, written once the session has tools
            loop = asyncio.get_running_loop()
            self.host_channel.mirrors.append(mirror_into(machine.running, loop))
        try:
            channel = await machine.start(self.router.accept, image=image)
            await channel.hello()
        except (MachineError, AgentError) as exc:
            if image is not None:
                raise ImageUnusable(f"the saved machine could not be restored: {exc}") from None
            raise
        if image is None:  # a restored machine has its listeners and forwarder already
            await open_inside(channel, self.spec, self.kernels.python, self.uid)
        machine.after_restart = self._reopen

    def channel_peer(self) -> ChannelPeer:
        # Only this service connects to the channels' host sockets (for the agent inside): no
        # host group is given their directories.
        return ChannelPeer(os.geteuid(), 0)

    async def _reopen(self, channel: AgentChannel) -> None:
        """In a machine booted afresh after its predecessor ended (a panic, a hang): the
        agent's listeners and forwarder, and the host-tool files, as at the first boot."""
        assert self.uid is not None
        await open_inside(channel, self.spec, self.kernels.python, self.uid)
        if self.host_channel is not None:
            for name in (MODULE_NAME, MANIFEST_NAME):
                path = self.host_channel.path / name
                if await asyncio.to_thread(path.is_file):
                    data = await asyncio.to_thread(path.read_bytes)
                    await push_file(channel, name, data)

    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> MicrovmSandbox:
        assert self.machine is not None and self.uid is not None
        sandbox = MicrovmSandbox(
            self.sandbox_id,
            self.spec,
            driver,
            dirs,
            Workspace(str(dirs.workspace)),
            languages=self.kernels.languages,
            make_driver=self.driver,
            backend=self.backend,
            machine=self.machine,
            image=self.image,
            uid=self.uid,
            launchers=self.launchers,
            uid_claimed=False,
            kernel_path=self.backend.config.kernel_path,
            root=self.backend.config.root,
        )
        assert isinstance(self.machine, QemuMachine)
        sandbox.runtime = self.machine.accelerator.name  # in the session's info: kvm or tcg
        return sandbox

    async def undo(self) -> None:
        if self.machine is not None:
            await self.machine.destroy()
        if self.qemu_uid is not None:  # no machine took it
            self.backend.uids.release(self.qemu_uid)
            self.qemu_uid = None
