"""The guest's first steps: a small initramfs (Debian's static busybox, the kernel's modules we
need, and `/init`, a script) that mounts the machine's disks and hands the machine to our agent.

The disks, in this order (qemu_machine.py attaches them so):
    vda  the image's root filesystem, ext4, shared by every machine of the image: read-only
    vdb  the machine's own root layer (ext4): `upper/` and `work/` of an overlay on vda, and
         the files of this session (its users, our programs) already in `upper/`
    vdc  the workspace (ext4, its size the workspace quota), at /workspace and /home/user
The agent (machine_agent.py) becomes PID 1 with the virtio-serial port named `AGENT_PORT` as
its stdin and stdout (one open of it: a port has one opener): the host's one way in. What the
script prints goes to the serial console, which the host keeps the last of (the reason a
machine that did not start gives).

Made once per kernel and busybox (by the digest of what goes in), kept beside the kernel.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX
from sandbox.backends.microvm.guest_kernel import GuestKernel

AGENT_PORT = "cir.agent"
AGENT_ARGV = ("/opt/kernel/bin/python", "-I", "-S", "/opt/code-interpreter/machine_agent.py")
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
RUN_SIZE_MB = 16
SHM_SIZE_MB = 64
# Said by /init on the serial console before it hands over: the host's sign the machine booted.
READY_MARK = "cir-init: handing over to the agent"

_INIT = """#!/bin/busybox sh
# The guest's first steps (sandbox/backends/microvm/guest_boot.py).
B=/bin/busybox
fail() {{ echo "cir-init: $*"; $B poweroff -f; }}
$B mount -t proc -o nosuid,nodev,noexec proc /proc || fail "no /proc"
$B mount -t sysfs -o nosuid,nodev,noexec sys /sys || fail "no /sys"
$B mount -t devtmpfs -o nosuid,noexec dev /dev || fail "no /dev"
for m in {modules}; do $B insmod /modules/$m.ko || fail "module $m did not load"; done
for d in vda vdb vdc; do
    n=0
    while [ ! -b /dev/$d ]; do
        n=$((n + 1)); [ $n -gt 500 ] && fail "no disk $d"; $B usleep 10000
    done
done
tmp=64; pids=256; files=1024; fsize=1024
for arg in $($B cat /proc/cmdline); do
    case "$arg" in
        cir.tmp=*) tmp="${{arg#cir.tmp=}}" ;;
        cir.pids=*) pids="${{arg#cir.pids=}}" ;;
        cir.files=*) files="${{arg#cir.files=}}" ;;
        cir.fsize=*) fsize="${{arg#cir.fsize=}}" ;;
    esac
done
$B mkdir -p /lower /layer /newroot
$B mount -t ext4 -o ro,noload /dev/vda /lower || fail "the root filesystem did not mount"
$B mount -t ext4 -o rw,nodev /dev/vdb /layer || fail "the root layer did not mount"
$B mount -t overlay -o lowerdir=/lower,upperdir=/layer/upper,workdir=/layer/work overlay \\
    /newroot || fail "the root overlay did not mount"
R=/newroot
$B mkdir -p $R{workspace} $R{home} $R/tmp $R/run $R/dev $R/proc $R/sys
$B mount -t ext4 -o rw,nosuid,nodev /dev/vdc $R{workspace} || fail "the workspace did not mount"
$B rmdir $R{workspace}/lost+found 2>/dev/null
$B mount --bind $R{workspace} $R{home}
$B mount -t tmpfs -o size=${{tmp}}m,mode=1777,nosuid,nodev tmpfs $R/tmp
# /run is the machine's memory, as in a gVisor machine; what the layers hold there (the
# host-tool files) is copied onto it.
$B mkdir -p /run-layers && $B cp -a $R/run/. /run-layers/
$B mount -t tmpfs -o size={run}m,mode=755,nosuid,nodev tmpfs $R/run
$B cp -a /run-layers/. $R/run/ || fail "/run not filled"
# The machine's /dev: only what a program expects (the disks, the ports, memory and the
# kernel's log stay in the first steps' /dev, where nothing after them reaches).
$B mount -t tmpfs -o size=64k,mode=755,nosuid,noexec devices $R/dev
for node in "null 1 3" "zero 1 5" "full 1 7" "random 1 8" "urandom 1 9" "tty 5 0"; do
    set -- $node
    $B mknod -m 666 $R/dev/$1 c $2 $3
done
$B mkdir -p $R/dev/pts $R/dev/shm
$B mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts $R/dev/pts
$B ln -s pts/ptmx $R/dev/ptmx
$B ln -s /proc/self/fd $R/dev/fd
$B ln -s /proc/self/fd/0 $R/dev/stdin
$B ln -s /proc/self/fd/1 $R/dev/stdout
$B ln -s /proc/self/fd/2 $R/dev/stderr
$B mount -t tmpfs -o size={shm}m,mode=1777,nosuid,nodev shm $R/dev/shm
$B mount --move /proc $R/proc
$B mount --move /sys $R/sys
$B hostname sandbox
# What programs write reaches the disks within a second or two (the kernel's default: 30 s),
# so a machine that must be ended (hung) loses little.
echo 100 > $R/proc/sys/vm/dirty_expire_centisecs
echo 100 > $R/proc/sys/vm/dirty_writeback_centisecs
$B ip link set lo up 2>/dev/null || $B ifconfig lo 127.0.0.1 up
port=""
for f in $R/sys/class/virtio-ports/*; do
    [ "$($B cat $f/name 2>/dev/null)" = "{port}" ] && port=$($B basename $f)
done
[ -n "$port" ] || fail "no agent port"
[ -c /dev/$port ] || fail "no agent port device"
# Inherited by the agent and all it starts; counted per user, so the sandbox's user is held
# (root is not: the agent, and what runs as root by the sandbox's own choice).
# busybox counts a file's size in 512-byte blocks.
ulimit -u $pids -n $files -c 0 -f $((fsize * 2048)) || fail "limits not set"
echo "{ready}"
exec $B env -i PATH=/usr/bin:/bin $B switch_root $R {agent} <>/dev/$port >&0
"""


def busybox_program() -> Path:
    """Debian's static busybox (`busybox-static`): a dynamic one could not run in the initramfs."""
    for candidate in BUSYBOX_CANDIDATES:
        path = Path(candidate)
        if path.is_file() and b"ld-linux" not in path.read_bytes()[: 1 << 16]:
            return path
    raise BackendUnavailable(
        "a static busybox is needed for the guest's first steps: `apt-get install busybox-static`"
    )


def init_script(kernel: GuestKernel) -> str:
    return _INIT.format(
        modules=" ".join(kernel.modules),
        workspace=WORKSPACE_IN_SANDBOX,
        home=HOME_IN_SANDBOX,
        run=RUN_SIZE_MB,
        shm=SHM_SIZE_MB,
        port=AGENT_PORT,
        ready=READY_MARK,
        agent=" ".join(AGENT_ARGV),
    )


def initramfs(kernel: GuestKernel) -> Path:
    """The kernel's initramfs, made once (by the digest of what it holds) beside the kernel."""
    busybox = busybox_program()
    script = init_script(kernel).encode()
    files: list[tuple[str, int, bytes]] = [
        ("bin/busybox", 0o755, busybox.read_bytes()),
        ("init", 0o755, script),
    ]
    for name in kernel.modules:
        files.append((f"modules/{name}.ko", 0o644, kernel.module_file(name).read_bytes()))
    digest = hashlib.sha256()
    for name, mode, data in files:
        digest.update(f"{name}\0{mode}\0{len(data)}\0".encode())
        digest.update(data)
    path = kernel.directory / f"initramfs-{digest.hexdigest()[:16]}.gz"
    if path.is_file():
        return path
    archive = newc_archive(["bin", "dev", "proc", "sys", "modules"], files)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(gzip.compress(archive, compresslevel=6, mtime=0))
    os.replace(partial, path)
    return path


def newc_archive(dirs: list[str], files: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the kernel's `newc` format: directories, then files, then the trailer
    (the format is a fixed ASCII header a member: too small a thing for a library)."""
    out = io.BytesIO()
    ino = 1

    def member(name: str, mode: int, data: bytes) -> None:
        nonlocal ino
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))
        ino += 1

    for name in dirs:
        member(name, stat.S_IFDIR | 0o755, b"")
    for name, mode, data in files:
        member(name, stat.S_IFREG | mode, data)
    member("TRAILER!!!", 0, b"")
    return out.getvalue()
