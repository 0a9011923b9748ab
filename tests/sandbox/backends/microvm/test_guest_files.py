"""A machine's workspace files through its agent: the real agent as a process over pipes, its
workspace a temporary directory (here outside any machine: the requests are the same)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import FileAccessError, FileMissing, FileTooLarge, InvalidPath
from sandbox.backends.gvisor.agent_channel import AgentChannel
from sandbox.backends.microvm.guest_files import GuestWorkspace
from sandbox.inside_kernel import machine_agent
from sandbox.inside_kernel.machine_wire import WINDOW
from sandbox.workspace_files import Workspace
from tests.sandbox.backends.gvisor.test_agent_channel import over_pipes

AS_ROOT = os.getuid() == 0
# The sandbox's user: another than ours where we may give files away.
UID, GID = (1234, 5678) if AS_ROOT else (os.getuid(), os.getgid())
needs_root = pytest.mark.skipif(not AS_ROOT, reason="giving files away and mounting need root")


class Guest:
    """An agent serving `root` as its workspace, and the workspace through it."""

    def __init__(self, channel: AgentChannel, process: subprocess.Popen[bytes], root: Path):
        self.channel = channel
        self.process = process
        self.root = root

        async def current() -> AgentChannel:
            return channel

        self.files = GuestWorkspace(current, UID, GID)

    @classmethod
    async def start(cls, root: Path) -> Guest:
        channel, process = await over_pipes([sys.executable, "-I", "-S", machine_agent.__file__])
        await channel.request("hello", root=channel.root_allowed, workspace=str(root))
        return cls(channel, process, root)

    async def stop(self) -> None:
        await self.channel.close()
        self.process.kill()
        await asyncio.to_thread(self.process.wait)


@pytest.fixture
async def guest(tmp_path: Path) -> AsyncIterator[Guest]:
    root = tmp_path / "workspace"
    root.mkdir()
    started = await Guest.start(root)
    yield started
    await started.stop()


async def test_a_small_file_written_then_read_back(guest: Guest) -> None:
    entry = await guest.files.write("notes/today.txt", b"hello")
    assert (entry.path, entry.kind, entry.size) == ("notes/today.txt", "file", 5)
    assert (guest.root / "notes/today.txt").read_bytes() == b"hello"
    assert await guest.files.read("notes/today.txt", max_bytes=5) == b"hello"
    assert (await guest.files.write("notes/today.txt", b"")).size == 0  # replaced
    assert await guest.files.read("notes/today.txt", max_bytes=5) == b""
    assert os.listdir(guest.root / "notes") == ["today.txt"]  # no temporary file left


async def test_a_file_of_many_windows_both_ways(guest: Guest, tmp_path: Path) -> None:
    data = os.urandom(20 * WINDOW + 123)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    entry = await guest.files.copy_in("big/data.bin", source)
    assert entry.size == len(data)
    assert (guest.root / "big/data.bin").read_bytes() == data
    sink = tmp_path / "sink.bin"
    assert await guest.files.copy_out("big/data.bin", sink, max_bytes=len(data)) == len(data)
    assert sink.read_bytes() == data
    assert await guest.files.read("big/data.bin", max_bytes=len(data)) == data


async def test_a_big_read_waits_on_credit_and_holds_up_nothing_else(guest: Guest) -> None:
    """The agent's one loop sends a file as the host's credit allows, answering meanwhile."""
    (guest.root / "big.bin").write_bytes(bytes(8 * WINDOW))
    stream = guest.channel.open_stream()
    try:
        answer = await guest.channel.request(
            "file_read", path="big.bin", stream=stream.sid, max_bytes=8 * WINDOW
        )
        assert answer["size"] == 8 * WINDOW
        (guest.root / "small.txt").write_bytes(b"x")
        assert (await guest.files.stat("small.txt")).size == 1  # while nothing was read
        assert len(stream._buffer) <= WINDOW
        total = 0
        while chunk := await stream.read():
            total += len(chunk)
        assert total == 8 * WINDOW
    finally:
        stream.close()


async def test_a_file_over_max_bytes_is_refused_before_it_is_sent(
    guest: Guest, tmp_path: Path
) -> None:
    (guest.root / "big.bin").write_bytes(bytes(5000))
    with pytest.raises(FileTooLarge, match="5000 bytes"):
        await guest.files.read("big.bin", max_bytes=4999)
    with pytest.raises(FileTooLarge):
        await guest.files.copy_out("big.bin", tmp_path / "out", max_bytes=10)
    assert await guest.files.read("big.bin", max_bytes=5000) == bytes(5000)


async def test_missing_files_and_wrong_kinds(guest: Guest) -> None:
    (guest.root / "dir").mkdir()
    with pytest.raises(FileMissing):
        await guest.files.read("nothing.txt", max_bytes=10)
    with pytest.raises(FileMissing):
        await guest.files.read("no/such/dir.txt", max_bytes=10)
    with pytest.raises(FileMissing):
        await guest.files.remove("nothing.txt")
    with pytest.raises(FileMissing):
        await guest.files.list_dir("nothing")
    with pytest.raises(FileAccessError, match="directory"):
        await guest.files.read("dir", max_bytes=10)
    with pytest.raises(FileAccessError, match="directory"):
        await guest.files.write("dir", b"x")
    os.mkfifo(guest.root / "pipe")
    with pytest.raises(FileAccessError, match="not a plain file"):
        await guest.files.read("pipe", max_bytes=10)


async def test_a_listing_is_the_host_workspaces_own(guest: Guest) -> None:
    """Same entries, same order, same escapes as sandbox/workspace_files.py's on the same tree."""
    root = guest.root
    (root / "a/b/c").mkdir(parents=True)
    (root / "a/b/c/deep.txt").write_bytes(b"deep")
    (root / "a/one.txt").write_bytes(b"1")
    (root / "z.txt").write_bytes(b"zz")
    (root / "a/link").symlink_to("/etc")
    os.mkdir(os.path.join(os.fsencode(root), b"bad\xffname"))
    os.close(os.open(os.path.join(os.fsencode(root), b"bad\xffname", b"in.txt"), os.O_CREAT))
    host = Workspace(str(root))
    for path, recursive in (("", True), ("", False), ("a", True), ("a/b", False)):
        listed = await guest.files.list_dir(path, recursive=recursive)
        assert listed == host.list_dir(path, recursive=recursive), (path, recursive)
    listed = await guest.files.list_dir(recursive=True)
    assert [e.path for e in listed if e.name_escaped] == ["bad\\xffname", "bad\\xffname/in.txt"]
    assert [(e.path, e.kind) for e in listed if e.kind != "file"][:4] == [
        ("a", "directory"),
        ("a/b", "directory"),
        ("a/b/c", "directory"),
        ("a/link", "symlink"),
    ]
    assert len(await guest.files.list_dir(recursive=True, limit=3)) == 3
    with pytest.raises(FileAccessError, match="not a directory"):
        await guest.files.list_dir("z.txt")


async def test_a_listing_past_a_control_frame_comes_whole(guest: Guest) -> None:
    for i in range(3000):
        (guest.root / f"file-with-a-longish-name-{i:05}.txt").touch()
    listed = await guest.files.list_dir()
    assert len(listed) == 3000 and listed[-1].path == "file-with-a-longish-name-02999.txt"


async def test_remove_a_file_and_a_tree(guest: Guest) -> None:
    (guest.root / "t/u/v").mkdir(parents=True)
    (guest.root / "t/u/v/f.txt").write_bytes(b"f")
    (guest.root / "t/g.txt").write_bytes(b"g")
    await guest.files.remove("t/g.txt")
    assert not (guest.root / "t/g.txt").exists()
    await guest.files.remove("t")
    assert os.listdir(guest.root) == []


@needs_root
async def test_made_files_and_directories_are_the_sandbox_users(guest: Guest) -> None:
    await guest.files.write("p/q/file.txt", b"x")
    for made in ("p", "p/q", "p/q/file.txt"):
        st = (guest.root / made).stat()
        assert (st.st_uid, st.st_gid) == (UID, GID), made
    assert (guest.root / "p/q/file.txt").stat().st_mode & 0o777 == 0o644
    entry = await guest.files.mkdir("m/n/o")
    assert (entry.path, entry.kind) == ("m/n/o", "directory")
    for made in ("m", "m/n", "m/n/o"):
        st = (guest.root / made).stat()
        assert (st.st_uid, st.st_gid) == (UID, GID), made
    assert (await guest.files.mkdir("m/n/o")).kind == "directory"  # there already: fine
    with pytest.raises(FileAccessError, match="not a directory"):
        await guest.files.mkdir("p/q/file.txt")


async def test_paths_that_leave_the_workspace_are_refused_on_both_sides(guest: Guest) -> None:
    for path in ("../escape.txt", "/etc/passwd", "a/../../escape.txt", "bad\x00name"):
        with pytest.raises(InvalidPath):
            await guest.files.write(path, b"x")
        with pytest.raises(InvalidPath):
            await guest.files.read(path, max_bytes=10)
        # The agent does not take the host's word for it.
        for op in ("file_stat", "file_remove"):
            answer = await guest.channel.request(op, path=path)
            assert answer["refused"] == "invalid_path", (op, path)
        stream = guest.channel.open_stream()
        answer = await guest.channel.request(
            "file_write", path=path, stream=stream.sid, uid=UID, gid=GID
        )
        stream.close()
        assert answer["refused"] == "invalid_path"
    assert not (guest.root.parent / "escape.txt").exists()


async def test_a_planted_symlink_is_never_followed(guest: Guest, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"secret")
    (guest.root / "link.txt").symlink_to(outside / "secret.txt")
    (guest.root / "linkdir").symlink_to(outside)
    for path in ("link.txt", "linkdir/secret.txt"):
        with pytest.raises(FileAccessError, match="symlink"):
            await guest.files.read(path, max_bytes=100)
        with pytest.raises(FileAccessError, match="symlink"):
            await guest.files.write(path, b"overwritten")
    with pytest.raises(FileAccessError, match="symlink"):
        await guest.files.write("linkdir/new.txt", b"new")
    with pytest.raises(FileAccessError, match="symlink"):
        await guest.files.list_dir("linkdir")
    assert (await guest.files.stat("linkdir")).kind == "symlink"
    await guest.files.remove("linkdir")  # the link, not what it points at
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == b"secret"
    assert (guest.root / "link.txt").is_symlink()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system of 1 MiB, to fill."""
    if not AS_ROOT:
        pytest.skip("mounting needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)


async def test_a_full_workspace_is_a_typed_error_and_leaves_nothing_behind(
    tiny_disk: Path,
) -> None:
    guest = await Guest.start(tiny_disk)
    try:
        with pytest.raises(FileTooLarge, match="full"):
            await guest.files.write("big.bin", bytes(4 << 20))
        assert os.listdir(tiny_disk) == []  # its temporary file removed
        assert (await guest.files.write("small.txt", b"fits")).size == 4
    finally:
        await guest.stop()
