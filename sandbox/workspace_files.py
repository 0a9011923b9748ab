"""File operations inside a workspace directory that no planted symlink can redirect.

Every path is walked one component at a time from a directory descriptor with O_NOFOLLOW, so a
symlink the sandboxed code left anywhere in the path is refused, never followed. FIFOs, devices
and hard links are refused too. Both backends keep their workspaces on the host and use this.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Literal

from code_interpreter_wire.errors import FileAccessError, FileMissing, FileTooLarge
from sandbox.dir_stack import DIR_FLAGS, DirStack, TreeChanged
from sandbox.tree_removal import remove_tree
from sandbox.workspace_paths import clean_path as clean_path  # its home; kept importable here

# Listings go this deep below the directory asked for; deeper directories are shown, not entered.
MAX_LIST_DEPTH = 4096


@dataclass(frozen=True)
class Entry:
    path: str
    kind: Literal["file", "directory", "symlink", "other"]
    size: int
    mtime: float
    # True when a name on the path is not valid UTF-8: `path` shows its bytes as \xNN escapes,
    # so it reads safely but names no file; the sandboxed code can rename it.
    name_escaped: bool = False


class Workspace:
    """A directory on this machine whose contents the sandboxed code controls."""

    def __init__(
        self,
        root: str,
        *,
        owner: tuple[int, int] | None = None,
        modes: tuple[int, int] = (0o644, 0o755),
    ) -> None:
        """`modes`: of the files and directories it makes (a volume's are every session's)."""
        self.root = root
        self.owner = owner  # files created for the sandbox are given to its user
        self.file_mode, self.dir_mode = modes

    @contextmanager
    def _dir(self, parts: tuple[str, ...], *, create: bool = False) -> Iterator[int]:
        fd = os.open(self.root, DIR_FLAGS)
        try:
            for part in parts:
                nxt = self._step(fd, part, create)
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def _step(self, fd: int, part: str, create: bool) -> int:
        """Open the subdirectory `part` of `fd` (making it if asked), never through a symlink."""
        for _ in range(3):  # the sandbox may be changing the directory meanwhile
            try:
                return os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileMissing(f"no such directory: {part!r}") from None
                try:
                    os.mkdir(part, self.dir_mode, dir_fd=fd)
                except FileExistsError:
                    continue
                if self.owner:
                    os.chown(part, *self.owner, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                raise FileAccessError(
                    f"{part!r} is not a directory of the workspace ({_why(exc)})"
                ) from exc
        raise FileAccessError(f"{part!r} keeps changing; try again")

    def read(self, path: str, *, max_bytes: int) -> bytes:
        sink = io.BytesIO()
        self.copy_out(path, sink, max_bytes=max_bytes)
        return sink.getvalue()

    def copy_out(self, path: str, sink: BinaryIO, *, max_bytes: int) -> int:
        """Copy a file into `sink` a chunk at a time (a large one is never whole in memory);
        return its size."""
        parts = clean_path(path)
        with self._dir(parts[:-1]) as dfd:
            fd = self._open_regular(dfd, parts[-1], os.O_RDONLY | os.O_NONBLOCK)
            try:
                size = os.fstat(fd).st_size
                if size > max_bytes:
                    raise FileTooLarge(f"{path!r} is {size} bytes; the limit is {max_bytes}")
                total = 0
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                    if total > max_bytes:
                        raise FileTooLarge(f"{path!r} grew past the limit of {max_bytes} bytes")
                    sink.write(chunk)
                return total
            finally:
                os.close(fd)

    def write(self, path: str, data: bytes) -> Entry:
        """Write a file; return what is now there."""
        return self.copy_in(path, io.BytesIO(data))

    def copy_in(self, path: str, source: BinaryIO, *, atomic: bool = False) -> Entry:
        """Write a file from `source`, a chunk at a time; return what is now there. `atomic`:
        written under a name of its own beside it, then renamed over it, so a write that fails
        (the disk full) leaves the file as it was."""
        parts = clean_path(path)
        with self._dir(parts[:-1], create=True) as dfd:
            if atomic:
                return self._replace(dfd, parts, source)
            name = parts[-1]
            try:
                fd = os.open(
                    name,
                    os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    self.file_mode,
                    dir_fd=dfd,
                )
            except OSError as exc:
                raise FileAccessError(f"cannot write {path!r}: {_why(exc)}") from exc
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                    raise FileAccessError(f"cannot write {path!r}: not a plain file")
                os.ftruncate(fd, 0)
                _write_all(fd, source)
                if self.owner:
                    os.fchown(fd, *self.owner)
                st = os.fstat(fd)
            except OSError as exc:
                raise _write_error(path, exc) from exc
            finally:
                os.close(fd)
        return Entry("/".join(parts), "file", st.st_size, st.st_mtime)

    def _replace(self, dfd: int, parts: tuple[str, ...], source: BinaryIO) -> Entry:
        path, name = "/".join(parts), parts[-1]
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                raise FileAccessError(f"cannot write {path!r}: not a plain file")
        partial = f".cir-partial-{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(partial, flags, self.file_mode, dir_fd=dfd)
        except OSError as exc:
            raise FileAccessError(f"cannot write {path!r}: {_why(exc)}") from exc
        try:
            try:
                _write_all(fd, source)
                if self.owner:
                    os.fchown(fd, *self.owner)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.rename(partial, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=dfd)
            raise _write_error(path, exc) from exc
        return Entry(path, "file", st.st_size, st.st_mtime)

    def stat(self, path: str) -> Entry | None:
        """What is at `path` (no link followed on the way or at the end), or None."""
        parts = clean_path(path)
        try:
            with self._dir(parts[:-1]) as dfd:
                shown, escaped = shown_name(parts[-1])
                return self._entry(dfd, parts[-1], "/".join((*parts[:-1], shown)), escaped)
        except FileMissing:
            return None

    def make_dirs(self, path: str) -> None:
        """Make a directory and its parents (what is there already is left as it is)."""
        with self._dir(clean_path(path), create=True):
            pass

    def remove(self, path: str) -> None:
        """Remove a file, a symlink (never what it points at) or a directory tree of any depth."""
        parts = clean_path(path)
        with self._dir(parts[:-1]) as dfd:
            try:
                remove_tree(dfd, parts[-1])
            except FileNotFoundError:
                raise FileMissing(f"no such file: {path!r}") from None
            except OSError as exc:
                raise FileAccessError(f"cannot remove {path!r}: {_why(exc)}") from exc

    def list_dir(
        self,
        path: str = "",
        *,
        recursive: bool = False,
        limit: int = 10_000,
        max_depth: int = MAX_LIST_DEPTH,
    ) -> list[Entry]:
        """Entries under `path`, at most `limit`: depth first, sorted within each directory.

        Each directory is opened once, from its parent's descriptor, so a walk costs O(entries)
        whatever the depth; directories more than `max_depth` below `path` are listed but not
        entered. A subdirectory that changes under the walk is skipped.
        """
        top = clean_path(path, allow_root=True)
        out: list[Entry] = []
        with self._dir(top) as top_fd:
            stack = DirStack(top_fd)
            try:
                pending = [_sorted_names(top_fd, path)]
                prefixes = [("/".join(top), False)]  # shown path, and whether it was escaped
                while pending and len(out) < limit:
                    if not pending[-1]:
                        pending.pop()
                        prefixes.pop()
                        if stack.depth:
                            stack.pop()
                        continue
                    name = pending[-1].pop()
                    prefix, escaped = prefixes[-1]
                    shown, name_escaped = shown_name(name)
                    rel = f"{prefix}/{shown}" if prefix else shown
                    entry = self._entry(stack.fd, name, rel, escaped or name_escaped)
                    if entry is None:
                        continue
                    out.append(entry)
                    if recursive and entry.kind == "directory" and stack.depth < max_depth:
                        try:
                            stack.push(name)
                        except OSError:
                            continue  # no longer a directory
                        try:
                            pending.append(_sorted_names(stack.fd, rel))
                        except FileAccessError:
                            stack.pop()
                            continue
                        prefixes.append((rel, entry.name_escaped))
            except TreeChanged as exc:
                raise FileAccessError(f"{path!r} changed while it was listed; try again") from exc
            finally:
                stack.close()
        return out

    @staticmethod
    def _entry(dfd: int, name: str, rel: str, escaped: bool) -> Entry | None:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        kind: Literal["file", "directory", "symlink", "other"] = (
            "directory"
            if stat.S_ISDIR(st.st_mode)
            else "file"
            if stat.S_ISREG(st.st_mode)
            else "symlink"
            if stat.S_ISLNK(st.st_mode)
            else "other"
        )
        return Entry(rel, kind, st.st_size if kind == "file" else 0, st.st_mtime, escaped)

    @staticmethod
    def _open_regular(dfd: int, name: str, flags: int) -> int:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise FileMissing(f"no such file: {name!r}") from None
        except OSError as exc:
            raise FileAccessError(f"cannot open {name!r}: {_why(exc)}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileAccessError(f"{name!r} is not a plain file")
        return fd


def _write_error(path: str, exc: OSError) -> FileTooLarge | FileAccessError:
    """A failed write as the models say it: no room (a full disk, a quota, the file size
    limit) is FileTooLarge."""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return FileTooLarge(f"cannot write {path!r}: {_why(exc)}")
    return FileAccessError(f"cannot write {path!r}: {_why(exc)}")


def _write_all(fd: int, source: BinaryIO) -> None:
    """`source` to `fd`, a chunk at a time, each written whole."""
    while chunk := source.read(1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def shown_name(name: str) -> tuple[str, bool]:
    """A name as listed: itself when it is valid UTF-8, else its bytes with \\xNN escapes
    (JSON and protobuf carry only valid text), and whether it was escaped."""
    if name.isascii():
        return name, False
    try:
        name.encode()
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "backslashreplace"), True
    return name, False


def _sorted_names(dfd: int, path: str) -> list[str]:
    """The directory's names in reverse order (the walk pops them from the end)."""
    try:
        return sorted(os.listdir(dfd), reverse=True)
    except OSError as exc:
        raise FileAccessError(f"cannot list {path!r}: {_why(exc)}") from exc


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symlink, and symlinks are never followed"
    if exc.errno == errno.EISDIR:
        return "it is a directory"
    return exc.strerror or str(exc)
