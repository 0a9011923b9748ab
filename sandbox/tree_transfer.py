"""A directory tree carried between two processes as a stream of bounded batches: a saved
machine moved from the node that paused it to the shared store, and from there to the node that
restores it (sandbox/backends/ray_cluster/machine_store.py).

The tree holds what a sandbox wrote (its workspace), so both ends treat it as hostile: the
reader never follows a link (a link is sent as a link, a special file is left out, a file is
opened without following a link at its name); the writer makes a new directory and puts each
entry in a directory it made itself from this stream, by a plain relative name, never through a
link and never over an existing name, so nothing outside that directory is ever touched; and
both count bytes and entries against caps. Owners, modes and times are kept: by `chown` where
the writer may (root), else in `OWNERS_FILE` beside the tree, which the reader of that copy
uses instead of the files' own owners.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from code_interpreter_wire.errors import SandboxError

BATCH_BYTES = 4 << 20  # file data in one batch (one Ray object)
MAX_ENTRIES = 200_000  # files, directories and links in one tree
MAX_NAME_BYTES = 4096  # a path or a link's target
MAX_TREE_NAME_BYTES = 32 << 20  # the paths and link targets of one tree, all told
MAX_OWNERS_FILE_BYTES = 64 << 20
OWNERS_FILE = ".tree-owners.json"  # owners a writer could not set, for the next reader
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

EntryKind = Literal["dir", "file", "link", "data"]


def tree_bytes(root: Path) -> int:
    """The bytes of the files under `root` (links not followed). Blocking."""
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def tree_disk_bytes(root: Path) -> int:
    """What the files under `root` take on disk, at most their sizes: a sparse file (a
    virtual machine's disk) only what it has written. Blocking."""
    return sum(
        min(st.st_size, st.st_blocks * 512)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
        for st in (p.lstat(),)
    )


class TreeRefused(SandboxError):
    """The stream is not a tree this end takes: over a cap, or a name it refuses."""


@dataclass(frozen=True)
class TreeEntry:
    """One entry of the stream: a directory, a file (its content follows as `data` entries),
    a link, or a piece of the last file's content."""

    kind: EntryKind
    path: str = ""  # relative, '/'-separated ("" for data)
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    target: str = ""  # a link's
    data: bytes = b""


def read_tree(
    root: Path, *, max_bytes: int, batch_bytes: int = BATCH_BYTES
) -> Iterator[list[TreeEntry]]:
    """The tree under `root` as batches of entries, each of at most about `batch_bytes` of
    data; `TreeRefused` past `max_bytes` of data, `MAX_ENTRIES` entries or
    `MAX_TREE_NAME_BYTES` of names. The tree must be still (a stopped machine's, a copy):
    its entries are never followed through a link, its directories are walked by name.
    Blocking: run it on a thread (a batch at a time)."""
    reader = _TreeReader(root, max_bytes, batch_bytes)
    yield from reader.batches()


class _TreeReader:
    def __init__(self, root: Path, max_bytes: int, batch_bytes: int) -> None:
        self.root, self.max_bytes, self.batch_bytes = root, max_bytes, batch_bytes
        self.owners = _read_owners(root)
        self.batch: list[TreeEntry] = []
        self.size = self.total = self.entries = self.names = 0
        self.pending = [(root, PurePosixPath())]

    def batches(self) -> Iterator[list[TreeEntry]]:
        while self.pending:
            directory, relative = self.pending.pop()
            with os.scandir(directory) as found:
                for entry in found:  # counted as listed: a huge directory is refused early
                    if directory == self.root and entry.name == OWNERS_FILE:
                        continue
                    yield from self._entry(entry, relative)
                    if len(self.batch) >= 4096:  # many small entries: batches stay small too
                        yield self._taken()
        if self.batch:
            yield self._taken()

    def _taken(self) -> list[TreeEntry]:
        batch, self.batch, self.size = self.batch, [], 0
        return batch

    def _entry(self, entry: os.DirEntry[str], relative: PurePosixPath) -> Iterator[list[TreeEntry]]:
        name = str(relative / entry.name)
        st = entry.stat(follow_symlinks=False)
        uid, gid, mode = self.owners.get(name, (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
        self.entries += 1
        self.names += len(os.fsencode(name))
        if self.entries > MAX_ENTRIES or self.names > MAX_TREE_NAME_BYTES:
            raise TreeRefused(
                f"the tree holds over {MAX_ENTRIES} entries or {MAX_TREE_NAME_BYTES} bytes of names"
            )
        mtime = st.st_mtime_ns
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(entry.path)
            self.names += len(os.fsencode(target))
            self.batch.append(TreeEntry("link", name, 0, uid, gid, mtime, target=target))
        elif stat.S_ISDIR(st.st_mode):
            self.batch.append(TreeEntry("dir", name, mode, uid, gid, mtime))
            self.pending.append((Path(entry.path), relative / entry.name))
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(entry.path, os.O_RDONLY | _NO_FOLLOW)
            with os.fdopen(fd, "rb") as reader:
                if not stat.S_ISREG(os.fstat(reader.fileno()).st_mode):
                    return  # replaced under us by something else: left out
                self.batch.append(TreeEntry("file", name, mode, uid, gid, mtime))
                while piece := reader.read(max(1, self.batch_bytes - self.size)):
                    self.total += len(piece)
                    if self.total > self.max_bytes:
                        raise TreeRefused(f"the tree holds over {self.max_bytes} bytes")
                    self.batch.append(TreeEntry("data", data=piece))
                    self.size += len(piece)
                    if self.size >= self.batch_bytes:
                        yield self._taken()
        # FIFOs, sockets and devices are left out


class TreeWriter:
    """Writes a stream of `read_tree` batches into `dest`, a directory it makes (its parent
    must exist; `dest` must not). `finish()` sets the directories' modes last; `abort()`
    removes what was written. Blocking: call it on a thread.

    A writer that may not set owners (not root) keeps each entry's owner and mode in
    `OWNERS_FILE` instead, and leaves its copy readable and removable by itself (files u+rw,
    directories u+rwx): a mode that shut out its owner must not make the copy unreadable, or
    impossible to delete."""

    def __init__(self, dest: Path, *, max_bytes: int, set_owners: bool | None = None) -> None:
        self.dest = dest
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries = 0
        self.names = 0
        os.mkdir(dest, 0o700)
        self._dirs: dict[str, TreeEntry] = {"": TreeEntry("dir")}  # made here, by name
        self._file: tuple[int, TreeEntry] | None = None  # the file being written
        self._kept: list[tuple[str, int, int, int]] = []  # (name, uid, gid, mode) not set
        # Owners set on the files (None: where it may, as root), else kept in OWNERS_FILE.
        self._chown = os.geteuid() == 0 if set_owners is None else set_owners

    def write(self, batch: list[TreeEntry]) -> None:
        for entry in batch:
            if entry.kind == "data":
                self._data(entry.data)
                continue
            self._end_file()
            self.entries += 1
            self.names += len(os.fsencode(entry.path)) + len(os.fsencode(entry.target))
            if self.entries > MAX_ENTRIES or self.names > MAX_TREE_NAME_BYTES:
                raise TreeRefused(
                    f"the tree holds over {MAX_ENTRIES} entries or {MAX_TREE_NAME_BYTES} bytes "
                    "of names"
                )
            name = _checked_name(entry.path)
            parent = name.rpartition("/")[0]
            if parent not in self._dirs:  # never through a link, nor a name not made here
                raise TreeRefused(f"{name!r} comes before its directory, or under a non-directory")
            where = self.dest / name
            if entry.kind == "dir":
                os.mkdir(where, 0o700)
                self._dirs[name] = entry
            elif entry.kind == "link":
                if len(os.fsencode(entry.target)) > MAX_NAME_BYTES or "\0" in entry.target:
                    raise TreeRefused(f"the link {name!r} has an impossible target")
                os.symlink(entry.target, where)
                if self._chown:
                    os.lchown(where, entry.uid, entry.gid)
                else:
                    self._kept.append((name, entry.uid, entry.gid, 0))
            elif entry.kind == "file":
                fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
                self._file = (fd, entry)
            else:
                raise TreeRefused(f"an entry of unknown kind {entry.kind!r}")

    def _data(self, data: bytes) -> None:
        if self._file is None:
            raise TreeRefused("file data with no file before it")
        self.bytes += len(data)
        if self.bytes > self.max_bytes:
            raise TreeRefused(f"the tree holds over {self.max_bytes} bytes")
        view = memoryview(data)
        while view:
            view = view[os.write(self._file[0], view) :]

    def _end_file(self) -> None:
        if self._file is None:
            return
        fd, entry = self._file
        self._file = None
        try:
            os.fchmod(fd, self._mode(entry, 0o600))
            if self._chown:  # owner first: a chown clears setuid and setgid bits
                os.fchown(fd, entry.uid, entry.gid)
                os.fchmod(fd, entry.mode & 0o7777)
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        finally:
            os.close(fd)

    def _mode(self, entry: TreeEntry, owner_needs: int) -> int:
        """The mode to set: the entry's own where owners are set, else its own with what this
        writer needs of its copy (the true one kept)."""
        mode = entry.mode & 0o7777
        if self._chown:
            return mode
        self._kept.append((entry.path, entry.uid, entry.gid, mode))
        return (mode & 0o777) | owner_needs  # no setuid on a copy its owners did not make

    def finish(self) -> None:
        """End the last file; then each directory's owner, mode and time (deepest first: a
        read-only directory was filled before)."""
        self._end_file()
        for name in sorted(self._dirs, key=len, reverse=True):
            if not name:
                continue
            entry, where = self._dirs[name], self.dest / name
            if self._chown:
                os.chown(where, entry.uid, entry.gid, follow_symlinks=False)
            os.chmod(where, self._mode(entry, 0o700), follow_symlinks=False)
            os.utime(where, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        if self._kept:
            kept = json.dumps(sorted(self._kept))
            if len(kept) > MAX_OWNERS_FILE_BYTES:  # a reader would refuse it: refused now
                raise TreeRefused(f"the tree's owners take over {MAX_OWNERS_FILE_BYTES} bytes")
            (self.dest / OWNERS_FILE).write_text(kept)

    def abort(self) -> None:
        if self._file is not None:
            os.close(self._file[0])
            self._file = None
        shutil.rmtree(self.dest, ignore_errors=True)


def _checked_name(path: str) -> str:
    """A plain relative name: no '..', no '.', no empty part, not absolute, bounded."""
    if not path or len(os.fsencode(path)) > MAX_NAME_BYTES or "\0" in path or path.startswith("/"):
        raise TreeRefused(f"the entry name {path[:200]!r} is refused")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts) or path == OWNERS_FILE:
        raise TreeRefused(f"the entry name {path[:200]!r} is refused")
    return path


def _read_owners(root: Path) -> dict[str, tuple[int, int, int]]:
    """The owners and modes a writer without the right to set them kept beside the tree."""
    found = root / OWNERS_FILE
    if not found.is_file():
        return {}
    if found.stat().st_size > MAX_OWNERS_FILE_BYTES:
        raise TreeRefused(f"{OWNERS_FILE} is over {MAX_OWNERS_FILE_BYTES} bytes")
    owners: dict[str, tuple[int, int, int]] = {}
    for name, uid, gid, mode in json.loads(found.read_text(errors="surrogateescape")):
        owners[str(name)] = (int(uid), int(gid), int(mode))  # links: mode 0, never read
    return owners
