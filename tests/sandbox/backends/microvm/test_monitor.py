"""The QMP monitor against real QEMU guests (TCG): a whole VM saved to a file and restored into a
new QEMU carries on where it was; a state that is not whole fails typed, at once.

The guest is a tiny initramfs: busybox answering commands on its serial console (QEMU's stdio),
holding a counter in a shell variable and a value in tmpfs, so every step is the test's request
and the guest's answer, never a sleep. QEMU runs confined as it will in the backend: the
`-sandbox` filter, and an unprivileged uid that has no passwd entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.backends.microvm.monitor import MigrationFailed, Monitor, MonitorError
from sandbox.uids import HostUidPool

pytestmark = pytest.mark.timeout(120)

QEMU = shutil.which("qemu-system-x86_64")
BUSYBOX = shutil.which("busybox")
ANSWER_TIMEOUT_S = 30.0  # a TCG boot on a loaded 2-core machine
# Debian's QEMU 7.2: its seccomp filter's `elevateprivileges=deny` forbids the setuid() that
# `-runas` makes (QEMU dies of SIGSYS), so `-runas` goes with `allow`; QEMU started as the uid
# itself keeps `deny`.
SANDBOX_WITH_RUNAS = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"
SANDBOX_AS_THE_UID = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

GUEST_INIT = """#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t devtmpfs dev /dev
$B mount -t tmpfs tmp /tmp
$B stty -F /dev/ttyS0 raw -echo
n=0
echo READY > /dev/ttyS0
while read -r cmd arg; do
  case "$cmd" in
    inc) n=$((n+1)); echo "COUNT $n";;
    set) echo "$arg" > /tmp/value; echo "OK";;
    get) echo "VALUE $($B cat /tmp/value)";;
    *) echo "WHAT $cmd";;
  esac
done < /dev/ttyS0 > /dev/ttyS0
"""


def _kernel() -> Path | None:
    try:
        from sandbox.backends.microvm import guest_kernel

        return guest_kernel.find().image
    except (ImportError, BackendUnavailable):
        return None


@dataclass(frozen=True)
class GuestFiles:
    directory: Path  # reachable by the guests' uid: 0711, the files 0644
    kernel: Path
    initrd: Path


@pytest.fixture(scope="module")
def guest_files() -> Iterator[GuestFiles]:
    kernel = _kernel()
    missing = [
        what
        for what, found in (("QEMU", QEMU), ("busybox", BUSYBOX), ("a guest kernel", kernel))
        if not found
    ]
    if missing or os.geteuid() != 0:
        why = f"{', '.join(missing) or 'root'} needed for the microvm monitor tests"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    assert kernel is not None and BUSYBOX is not None
    directory = Path(tempfile.mkdtemp(prefix="cir-test-microvm-", dir="/tmp"))
    try:
        directory.chmod(0o711)
        root = directory / "initramfs"
        for name in ("bin", "dev", "proc", "tmp"):
            (root / name).mkdir(parents=True)
        shutil.copyfile(BUSYBOX, root / "bin" / "busybox")
        (root / "bin" / "busybox").chmod(0o755)
        (root / "init").write_text(GUEST_INIT)
        (root / "init").chmod(0o755)
        initrd = directory / "initrd.gz"
        archive = subprocess.run(
            f"find . | {BUSYBOX} cpio -o -H newc | gzip -1",
            shell=True,
            cwd=root,
            check=True,
            capture_output=True,
        )
        initrd.write_bytes(archive.stdout)
        shutil.copyfile(kernel, directory / "vmlinuz")  # the cache under /root is not the uid's
        for path in (initrd, directory / "vmlinuz"):
            path.chmod(0o644)
        yield GuestFiles(directory, directory / "vmlinuz", initrd)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def guest_uid() -> Iterator[int]:
    """A uid of the kind the backend allocates: claimed for this module, no passwd entry."""
    pool = HostUidPool(1_800_000, 10_000)
    uid = pool.allocate()
    try:
        yield uid
    finally:
        pool.release(uid)


class Guest:
    """One QEMU process: its serial console on stdio, its monitor on a socket."""

    def __init__(self, process: asyncio.subprocess.Process, monitor: Monitor) -> None:
        self.process = process
        self.monitor = monitor

    async def answer(self) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            line = await self.process.stdout.readline()
        if not line:
            raise AssertionError("QEMU closed the serial console (it exited)")
        return line.decode(errors="replace").strip()

    async def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()
        return await self.answer()

    async def booted(self) -> None:
        while await self.answer() != "READY":
            pass

    async def stderr(self) -> str:
        assert self.process.stderr is not None
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            return (await self.process.stderr.read()).decode(errors="replace")


def qemu_argv(files: GuestFiles, qmp: Path, confinement: Sequence[str]) -> list[str]:
    assert QEMU is not None
    return [
        QEMU,
        *("-machine", "q35", "-accel", "tcg", "-cpu", "max", "-m", "256", "-smp", "1"),
        *("-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio"),
        *("-kernel", str(files.kernel), "-initrd", str(files.initrd), "-no-reboot"),
        *("-append", "console=ttyS0 panic=-1 quiet loglevel=0"),
        *("-qmp", f"unix:{qmp},server=on,wait=off"),
        *confinement,
    ]


class Guests:
    """Starts QEMUs alike (a restore needs the saved VM's very command line); kills leftovers."""

    def __init__(self, files: GuestFiles, uid: int, as_the_uid: bool) -> None:
        self.files = files
        self.uid = uid
        self.as_the_uid = as_the_uid
        self.sockets = Path(tempfile.mkdtemp(prefix="qmp-", dir=files.directory))
        os.chown(self.sockets, uid, uid)  # QEMU started as the uid makes its socket here
        self.started: list[Guest] = []

    async def start(self, incoming: bool = False) -> Guest:
        qmp = self.sockets / f"{len(self.started)}.qmp"
        if self.as_the_uid:
            confinement = ["-sandbox", SANDBOX_AS_THE_UID]
        else:
            confinement = ["-sandbox", SANDBOX_WITH_RUNAS, "-runas", f"{self.uid}:{self.uid}"]
        argv = qemu_argv(self.files, qmp, confinement)
        if incoming:
            argv += ["-incoming", "defer"]
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            user=self.uid if self.as_the_uid else None,
            group=self.uid if self.as_the_uid else None,
            extra_groups=[] if self.as_the_uid else None,
        )
        try:
            monitor = await Monitor.connect(qmp, timeout_s=ANSWER_TIMEOUT_S)
        except BaseException:
            process.kill()
            await process.wait()
            raise
        guest = Guest(process, monitor)
        self.started.append(guest)
        return guest

    async def close(self) -> None:
        for guest in self.started:
            await guest.monitor.close()
            if guest.process.returncode is None:
                guest.process.kill()
            await guest.process.wait()
        shutil.rmtree(self.sockets, ignore_errors=True)


@contextlib.asynccontextmanager
async def guests(files: GuestFiles, uid: int, as_the_uid: bool = False) -> AsyncIterator[Guests]:
    made = Guests(files, uid, as_the_uid)
    try:
        yield made
    finally:
        await made.close()


async def quit_guest(guest: Guest) -> None:
    await guest.monitor.quit()
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        assert await guest.process.wait() == 0


def credentials_of(pid: int) -> tuple[str, str, str]:
    """A process's (real uid, supplementary groups, seccomp mode), from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return fields["Uid"].split()[0], fields["Groups"].strip(), fields["Seccomp"].strip()


@dataclass(frozen=True)
class Saved:
    state: Path
    count: int
    value: str


@pytest.fixture(scope="module")
async def saved(guest_files: GuestFiles, guest_uid: int) -> AsyncIterator[Saved]:
    """A guest (QEMU under `-runas uid:gid`) that counted to 2 and keeps a value, saved while
    running; it answers after the save, once resumed."""
    async with guests(guest_files, guest_uid) as made:
        guest = await made.start()
        await guest.booted()
        assert credentials_of(guest.process.pid) == (str(guest_uid), str(guest_uid), "2")
        assert [await guest.ask("inc"), await guest.ask("inc")] == ["COUNT 1", "COUNT 2"]
        assert await guest.ask("set before-the-save") == "OK"
        state = guest_files.directory / "running.state"
        size = await guest.monitor.save_to(state)
        # Root's 0600 file: QEMU (the uid) wrote it through the descriptor it was handed.
        assert (state.stat().st_size, state.stat().st_mode & 0o777) == (size, 0o600)
        assert not list(guest_files.directory.glob(".running.state.*"))  # the partial, renamed
        assert await guest.monitor.status() == "postmigrate"
        await guest.monitor.resume()
        assert await guest.ask("inc") == "COUNT 3"
        await quit_guest(guest)
        yield Saved(state, 2, "before-the-save")


async def test_a_saved_guest_carries_on_in_a_new_qemu(
    saved: Saved, guest_files: GuestFiles, guest_uid: int
) -> None:
    async with guests(guest_files, guest_uid) as made:
        restored = await made.start(incoming=True)
        assert await restored.monitor.status() == "inmigrate"
        await restored.monitor.load_from(saved.state)
        assert await restored.monitor.status() == "running"
        assert await restored.ask("inc") == f"COUNT {saved.count + 1}"
        assert await restored.ask("get") == f"VALUE {saved.value}"

        # Stopped first, then saved to a descriptor of ours: it stays stopped until resumed.
        await restored.monitor.pause()
        assert await restored.monitor.status() == "paused"
        again = guest_files.directory / "paused.state"
        fd = os.open(again, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            size = await restored.monitor.save_to(fd)
        finally:
            os.close(fd)
        assert size == again.stat().st_size > 0
        assert await restored.monitor.status() == "postmigrate"
        await restored.monitor.resume()
        assert await restored.ask("set after-the-second-save") == "OK"
        await quit_guest(restored)

        # The second restore is the state at the second save, not what came after it.
        twice = await made.start(incoming=True)
        fd = os.open(again, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await twice.monitor.load_from(fd)
        finally:
            os.close(fd)
        assert await twice.ask("inc") == f"COUNT {saved.count + 2}"
        assert await twice.ask("get") == f"VALUE {saved.value}"
        await quit_guest(twice)


async def test_a_failed_save_says_why_and_the_guest_carries_on(
    saved: Saved, guest_files: GuestFiles, guest_uid: int
) -> None:
    async with guests(guest_files, guest_uid) as made:
        guest = await made.start(incoming=True)
        await guest.monitor.load_from(saved.state)
        read_only = os.open(saved.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(MigrationFailed, match="the save failed: Unable to write"):
                await guest.monitor.save_to(read_only)
        finally:
            os.close(read_only)
        assert await guest.monitor.status() == "paused"
        await guest.monitor.resume()
        assert await guest.ask("inc") == f"COUNT {saved.count + 1}"
        await quit_guest(guest)


def _truncated(state: bytes) -> bytes:
    return state[: len(state) // 2]


def _torn_header(state: bytes) -> bytes:
    return state[:100] + b"\xff" * 4096 + state[4196:]


def _torn_in_ram(state: bytes) -> bytes:
    """8 KiB of 0xff mid-RAM: whatever the alignment, it spans a whole page record's header
    (a record is at most 8 + 4096 bytes), whose flags then make no sense to QEMU. A change
    inside a page's data alone would load unnoticed: the stream carries no checksum."""
    middle = len(state) // 2
    return state[:middle] + b"\xff" * 8192 + state[middle + 8192 :]


@pytest.mark.parametrize("damage", [_truncated, _torn_header, _torn_in_ram])
async def test_a_damaged_state_fails_typed_and_at_once(
    damage: Callable[[bytes], bytes],
    saved: Saved,
    guest_files: GuestFiles,
    guest_uid: int,
    tmp_path: Path,
) -> None:
    damaged = tmp_path / "damaged.state"
    damaged.write_bytes(damage(saved.state.read_bytes()))
    async with guests(guest_files, guest_uid) as made:
        guest = await made.start(incoming=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(MigrationFailed, match="did not load"):
            await guest.monitor.load_from(damaged, timeout_s=20)
        assert loop.time() - started < 5
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            assert await guest.process.wait() != 0  # QEMU 7.2 exits on a failed load
        assert "load of migration failed" in await guest.stderr()
        with pytest.raises(MonitorError):
            await guest.monitor.status()


async def test_what_is_not_a_state_is_refused_before_qemu_reads_it(
    guest_files: GuestFiles, guest_uid: int, tmp_path: Path
) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "text").write_bytes(b"not a saved machine\n")
    async with guests(guest_files, guest_uid) as made:
        guest = await made.start(incoming=True)
        for name in ("empty", "text"):
            with pytest.raises(MigrationFailed, match="not a QEMU state file"):
                await guest.monitor.load_from(tmp_path / name)
        with pytest.raises(MigrationFailed, match="cannot open"):
            await guest.monitor.load_from(tmp_path / "absent")
        assert await guest.monitor.status() == "inmigrate"  # still waiting for a real one
        await quit_guest(guest)


async def test_qemu_started_as_the_uid_keeps_setuid_denied_and_saves_and_restores(
    guest_files: GuestFiles, guest_uid: int
) -> None:
    async with guests(guest_files, guest_uid, as_the_uid=True) as made:
        guest = await made.start()
        await guest.booted()
        assert credentials_of(guest.process.pid) == (str(guest_uid), "", "2")
        assert await guest.ask("set as-the-uid") == "OK"
        state = guest_files.directory / "as-the-uid.state"
        await guest.monitor.save_to(state)
        await quit_guest(guest)

        restored = await made.start(incoming=True)
        await restored.monitor.load_from(state)
        assert await restored.ask("get") == "VALUE as-the-uid"
        assert await restored.ask("inc") == "COUNT 1"
        await quit_guest(restored)


async def test_no_monitor_there_is_a_typed_error_in_time(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(MonitorError, match="no QMP monitor"):
        await Monitor.connect(tmp_path / "nobody.qmp", timeout_s=0.3)
    assert loop.time() - started < 3
