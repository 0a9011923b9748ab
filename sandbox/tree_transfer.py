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

BATCH_BYTES = 4 << 20  # file data in one batch (one Ray object)
MAX_ENTRIES = 200_000  # files, directories and links in one tree
MAX_NAME_BYTES = 4096  # a path or a link's target
OWNERS_FILE = ".tree-owners.json"  # owners a writer could not set, for the next reader
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

EntryKind = Literal["dir", "file", "link", "data"]


class TreeRefused(Exception):
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
    data; `TreeRefused` past `max_bytes` of data or `MAX_ENTRIES` entries. Blocking: run it
    on a thread (a batch at a time)."""
    owners = _read_owners(root)
    batch: list[TreeEntry] = []
    size = total = entries = 0
    pending = [(root, PurePosixPath())]
    while pending:
        directory, relative = pending.pop()
        with os.scandir(directory) as found:
            listed = sorted(found, key=lambda entry: entry.name)
        for entry in listed:
            if directory == root and entry.name == OWNERS_FILE:
                continue
            name = str(relative / entry.name)
            st = entry.stat(follow_symlinks=False)
            uid, gid = owners.get(name, (st.st_uid, st.st_gid))
            entries += 1
            if entries > MAX_ENTRIES:
                raise TreeRefused(f"the tree holds over {MAX_ENTRIES} entries")
            mode, mtime = stat.S_IMODE(st.st_mode), st.st_mtime_ns
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(entry.path)
                batch.append(TreeEntry("link", name, 0, uid, gid, mtime, target=target))
            elif stat.S_ISDIR(st.st_mode):
                batch.append(TreeEntry("dir", name, mode, uid, gid, mtime))
                pending.append((Path(entry.path), relative / entry.name))
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(entry.path, os.O_RDONLY | _NO_FOLLOW)
                with os.fdopen(fd, "rb") as reader:
                    if not stat.S_ISREG(os.fstat(reader.fileno()).st_mode):
                        continue  # replaced under us by something else: left out
                    batch.append(TreeEntry("file", name, mode, uid, gid, mtime))
                    while piece := reader.read(max(1, batch_bytes - size)):
                        total += len(piece)
                        if total > max_bytes:
                            raise TreeRefused(f"the tree holds over {max_bytes} bytes")
                        batch.append(TreeEntry("data", data=piece))
                        size += len(piece)
                        if size >= batch_bytes:
                            yield batch
                            batch, size = [], 0
            # FIFOs, sockets and devices are left out
            if len(batch) >= 4096:  # many small entries: a batch stays small too
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


class TreeWriter:
    """Writes a stream of `read_tree` batches into `dest`, a directory it makes (its parent
    must exist; `dest` must not). `finish()` sets the directories' modes last; `abort()`
    removes what was written. Blocking: call it on a thread."""

    def __init__(self, dest: Path, *, max_bytes: int, set_owners: bool | None = None) -> None:
        self.dest = dest
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries = 0
        os.mkdir(dest, 0o700)
        self._dirs: dict[str, TreeEntry] = {"": TreeEntry("dir")}  # made here, by name
        self._file: tuple[int, TreeEntry] | None = None  # the file being written
        self._owners: dict[str, tuple[int, int]] = {}
        # Owners set on the files (None: where it may, as root), else kept in OWNERS_FILE.
        self._chown = os.geteuid() == 0 if set_owners is None else set_owners

    def write(self, batch: list[TreeEntry]) -> None:
        for entry in batch:
            if entry.kind == "data":
                self._data(entry.data)
                continue
            self._end_file()
            self.entries += 1
            if self.entries > MAX_ENTRIES:
                raise TreeRefused(f"the tree holds over {MAX_ENTRIES} entries")
            name = _checked_name(entry.path)
            parent = name.rpartition("/")[0]
            if parent not in self._dirs:  # never through a link, nor a name not made here
                raise TreeRefused(f"{name!r} comes before its directory, or under a non-directory")
            where = self.dest / name
            if entry.kind == "dir":
                os.mkdir(where, 0o700)
                self._dirs[name] = entry
            elif entry.kind == "link":
                if len(entry.target.encode()) > MAX_NAME_BYTES or "\0" in entry.target:
                    raise TreeRefused(f"the link {name!r} has an impossible target")
                os.symlink(entry.target, where)
                self._own(where, entry, link=True)
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
            os.fchmod(fd, entry.mode & 0o7777)
            self._own(fd, entry)
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        finally:
            os.close(fd)

    def _own(self, where: int | Path, entry: TreeEntry, *, link: bool = False) -> None:
        if not self._chown:
            self._owners[entry.path] = (entry.uid, entry.gid)
        elif isinstance(where, int):
            os.fchown(where, entry.uid, entry.gid)
        elif link:
            os.lchown(where, entry.uid, entry.gid)
        else:
            os.chown(where, entry.uid, entry.gid)

    def finish(self) -> None:
        """End the last file; then each directory's owner, mode and time (deepest first: a
        read-only directory was filled before)."""
        self._end_file()
        for name in sorted(self._dirs, key=len, reverse=True):
            if not name:
                continue
            entry, where = self._dirs[name], self.dest / name
            self._own(where, entry)
            os.chmod(where, entry.mode & 0o7777, follow_symlinks=False)
            os.utime(where, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        if self._owners:
            owners = [[name, uid, gid] for name, (uid, gid) in sorted(self._owners.items())]
            (self.dest / OWNERS_FILE).write_text(json.dumps(owners))

    def abort(self) -> None:
        if self._file is not None:
            os.close(self._file[0])
            self._file = None
        shutil.rmtree(self.dest, ignore_errors=True)


def _checked_name(path: str) -> str:
    """A plain relative name: no '..', no '.', no empty part, not absolute, bounded."""
    if not path or len(path.encode()) > MAX_NAME_BYTES or "\0" in path or path.startswith("/"):
        raise TreeRefused(f"the entry name {path[:200]!r} is refused")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts) or path == OWNERS_FILE:
        raise TreeRefused(f"the entry name {path[:200]!r} is refused")
    return path


def _read_owners(root: Path) -> dict[str, tuple[int, int]]:
    """The owners a writer without the right to set them kept beside the tree."""
    found = root / OWNERS_FILE
    if not found.is_file():
        return {}
    owners: dict[str, tuple[int, int]] = {}
    for name, uid, gid in json.loads(found.read_text()):
        owners[str(name)] = (int(uid), int(gid))
    return owners
