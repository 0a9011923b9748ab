"""QEMU for machines: the program, the accelerator this host gives guests, and a machine's
command line.

The accelerator: KVM where `/dev/kvm` runs a guest (tried once per process: a guest boots and
says so), with QEMU's `microvm` machine (virtio over MMIO, no PCI, no firmware to walk); else
TCG, QEMU's own CPU emulation, with the `q35` machine. Under TCG the emulator is the wall, so
QEMU itself runs confined wherever it runs: its own uid (`-runas`), an empty root (`-chroot`),
its seccomp filter (`-sandbox on`: no new programs, no privileges, no resource control), no
network device, no host file but the disks and sockets it was given at start (docs/microvm.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.backends.microvm.guest_boot import AGENT_PORT, busybox_program, newc_archive
from sandbox.backends.microvm.guest_kernel import GuestKernel
from sandbox.program_version import program_version

log = logging.getLogger(__name__)

PROGRAM = "qemu-system-x86_64"
KVM_PROBE_TIMEOUT_S = 30.0
# elevateprivileges stays allowed: QEMU 7.2 installs its filter before `-runas` drops to the
# machine's uid (a filter denying set*id kills it there); once dropped, no uid is regained.
SECCOMP = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"
_PROBE_MARK = "cir-kvm-probe-ok"
TCG_CODE_MB = 128
IO_THREADS = 16
# No device but those named, no config file, no display; the console on stdout; a guest that
# reboots ends instead.
_BARE = (
    "-nodefaults",
    "-no-user-config",
    "-display",
    "none",
    "-serial",
    "stdio",
    "-no-reboot",
)


@dataclass(frozen=True)
class Accelerator:
    """How guests run here: `kvm` (machine `microvm`) or `tcg` (machine `q35`)."""

    name: str
    machine: str
    reason: str  # why this one: said in the session's info and the logs

    @property
    def own_memory_mb(self) -> int:
        """QEMU's memory beside the guest's: its own, and under TCG its translated code."""
        return 256 + (TCG_CODE_MB if self.name == "tcg" else 0)

    @property
    def mmio(self) -> bool:
        """Its devices are on MMIO (microvm) rather than PCI (q35)."""
        return self.machine == "microvm"

    def device(self, kind: str) -> str:
        """The virtio device `kind` (blk, serial, rng) of this machine's bus."""
        return f"virtio-{kind}-device" if self.mmio else f"virtio-{kind}-pci"

    def arguments(self) -> list[str]:
        # TCG's translated code is kept in a buffer of 1 GiB by default, which grows into the
        # machine's host memory: a tenth of it holds a session's code well enough.
        accel = "kvm" if self.name == "kvm" else f"tcg,thread=multi,tb-size={TCG_CODE_MB}"
        # The microvm machine's legacy timer stays under TCG: without KVM's clock, the guest
        # calibrates its TSC against it (without it, its boot stops there).
        pit = "off" if self.name == "kvm" else "on"
        machine = f"microvm,rtc=on,pit={pit},pic=off" if self.mmio else "q35,vmport=off"
        cpu = "host" if self.name == "kvm" else "max"
        return ["-machine", machine, "-accel", accel, "-cpu", cpu]


def qemu_program() -> str:
    found = shutil.which(PROGRAM)
    if found is None:
        raise BackendUnavailable(
            "QEMU is not installed: `apt-get install qemu-system-x86 busybox-static`"
            " (docs/microvm.md)"
        )
    if os.geteuid() != 0:
        raise BackendUnavailable(
            "the microvm backend starts QEMU as root, which then drops to a uid of its own"
        )
    return found


async def qemu_version() -> str:
    """What this host's QEMU says it is (what a saved machine must have been saved by)."""
    return await program_version(qemu_program())


_accelerator: Accelerator | None = None
_probe_lock = asyncio.Lock()


async def accelerator(kernel: GuestKernel) -> Accelerator:
    """KVM if a guest boots on it here, else TCG; found once per process."""
    global _accelerator
    async with _probe_lock:
        if _accelerator is None:
            _accelerator = await _probe(kernel)
            log.info("microvm guests run on %s: %s", _accelerator.name, _accelerator.reason)
        return _accelerator


async def _probe(kernel: GuestKernel) -> Accelerator:
    tcg = "q35"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Accelerator("tcg", tcg, f"/dev/kvm cannot be opened ({exc.strerror})")
    os.close(fd)
    with tempfile.TemporaryDirectory(prefix="cir-kvm-probe-") as work:
        initrd = Path(work) / "probe.gz"
        _probe_initramfs(initrd)
        try:
            process = await asyncio.create_subprocess_exec(
                qemu_program(),
                *Accelerator("kvm", "microvm", "").arguments(),
                "-m",
                "128",
                *_BARE,
                "-kernel",
                str(kernel.image),
                "-initrd",
                str(initrd),
                "-append",
                "console=ttyS0 panic=-1 quiet",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            return Accelerator("tcg", tcg, f"QEMU did not start on KVM: {exc}")
        try:
            out, _ = await asyncio.wait_for(process.communicate(), KVM_PROBE_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            return Accelerator("tcg", tcg, "a guest on KVM did not boot in time")
    if _PROBE_MARK.encode() in out:
        return Accelerator("kvm", "microvm", "/dev/kvm runs guests")
    last = out.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return Accelerator("tcg", tcg, f"a guest on KVM did not boot here ({last[0][:200]})")


def _probe_initramfs(target: Path) -> None:
    """A guest that says it booted, then powers off."""
    script = f"#!/bin/busybox sh\necho {_PROBE_MARK}\n/bin/busybox poweroff -f\n".encode()
    files = [("bin/busybox", 0o755, busybox_program().read_bytes()), ("init", 0o755, script)]
    target.write_bytes(gzip.compress(newc_archive(["bin", "dev", "proc", "sys"], files)))


@dataclass(frozen=True)
class MachineLayout:
    """What one machine is started with."""

    kernel: GuestKernel
    initramfs: Path
    rootfs: Path  # shared, read-only
    root_layer: Path  # the machine's own
    workspace: Path  # the machine's own
    agent_socket: Path
    monitor_socket: Path
    chroot: Path  # an empty directory QEMU runs in once started
    memory_mb: int
    cpus: int
    tmp_mb: int
    pids: int  # the sandbox user's processes at most, inside
    open_files: int
    file_size_mb: int
    uid: int
    gid: int


def command_line(program: str, accel: Accelerator, layout: MachineLayout) -> list[str]:
    """QEMU's arguments for `layout` (a restore adds `-incoming defer`)."""

    def disk(name: str, path: Path, *, read_only: bool) -> list[str]:
        # auto-read-only off: else a save's inactivation of the disk opens its file again, by
        # name, which QEMU (its own uid by then) may not. Locking off: each machine has its
        # own files, and the shared root is never written.
        options = (
            f"file={path},if=none,id={name},format=raw,cache=writeback,aio=threads,"
            "auto-read-only=off,file.locking=off"
        )
        if read_only:
            options += ",readonly=on"
        return ["-drive", options, "-device", f"{accel.device('blk')},drive={name}"]

    cmdline = (
        "console=ttyS0 quiet panic=-1"
        f" cir.tmp={layout.tmp_mb} cir.pids={layout.pids} cir.files={layout.open_files}"
        f" cir.fsize={layout.file_size_mb}"
    )
    if accel.mmio:
        cmdline += " reboot=t"
    return [
        program,
        "-name",
        "cir-machine,debug-threads=off",
        *accel.arguments(),
        "-m",
        str(layout.memory_mb),
        "-smp",
        str(layout.cpus),
        *_BARE,
        "-nic",
        "none",
        "-kernel",
        str(layout.kernel.image),
        "-initrd",
        str(layout.initramfs),
        "-append",
        cmdline,
        *disk("root", layout.rootfs, read_only=True),
        *disk("layer", layout.root_layer, read_only=False),
        *disk("workspace", layout.workspace, read_only=False),
        "-device",
        f"{accel.device('serial')},max_ports=2",
        "-chardev",
        f"socket,id=agent,path={layout.agent_socket},server=on,wait=on",
        "-device",
        f"virtserialport,chardev=agent,name={AGENT_PORT}",
        "-device",
        accel.device("rng"),
        "-qmp",
        f"unix:{layout.monitor_socket},server=on,wait=off",
        # Its I/O threads at most IO_THREADS (its pids limit counts them: machine.py).
        "-object",
        f"main-loop,id=main-loop,thread-pool-max={IO_THREADS}",
        "-sandbox",
        SECCOMP,
        "-runas",
        f"{layout.uid}:{layout.gid}",
        "-chroot",
        str(layout.chroot),
    ]
