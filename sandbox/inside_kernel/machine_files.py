"""A machine's workspace files, for the host that cannot reach them: the agent's file requests.

A microvm machine keeps its workspace on a disk of its own, mounted inside (`WORKSPACE`), so the
host reads and writes those files through the agent (machine_agent.py) instead of in a host
directory. The semantics are sandbox/workspace_files.py's, which the host uses where it can
reach the files: every path is walked a component at a time from directory descriptors with
O_NOFOLLOW, so no symlink the sandboxed code planted is ever followed; FIFOs, devices and hard
links are refused; a listing shows names that are not UTF-8 with \\xNN escapes. The host checks
paths before it asks (workspace_paths.clean_path); they are checked here again, since the
host's checks are not the agent's.

Requests (paths relative to the workspace; `stream` an id the host opened):
    file_read    path, stream, max_bytes -> {"size"}: then the file's bytes on `stream` under
                 its credit (at most max_bytes + 1: one more says it grew past), then EOF; a
                 file over max_bytes is refused before anything is sent
    file_write   path, stream, uid, gid, mode (null: the replaced file's, else 0o644) -> {}:
                 the host sends the bytes on `stream`, then EOF; the agent answers on the
                 stream with one JSON object, {"entry"} or a refusal, then EOF (at once if a
                 write fails; what the host still sends is taken and dropped). Written to a
                 temporary name, owned by uid:gid, renamed over the file at the end; parents
                 made as needed, theirs too
    file_list    path, recursive, stream, limit -> {"count", "truncated"}: then the entries on
                 `stream`, one JSON object a line, then EOF (a listing may pass a control
                 frame's MAX_PAYLOAD): at most LIST_LIMIT entries and MAX_LIST_BYTES bytes
    file_remove  path -> {}: a file, a symlink (never what it points at) or a directory tree
    file_mkdir   path, uid, gid -> {"entry"}: with its parents, made theirs
    file_stat    path -> {"entry"}: the path itself (a symlink is not followed)
An entry: {"path", "kind" ("file" | "directory" | "symlink" | "other"), "size", "mtime",
"escaped"}. A refusal is an answer, not a failure: {"ok": true, "refused": kind, "message"},
`kind` one of the names below, which the host maps to its typed errors.

Standard library only: it runs inside the machine, imported by the agent as a sibling file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import Any

WORKSPACE = "/workspace"  # where the agent finds the workspace unless its hello says otherwise
LIST_LIMIT = 10_000  # entries in one listing, at most
MAX_LIST_BYTES = 16 << 20  # a listing's lines, at most
MAX_LIST_DEPTH = 4096  # directories deeper below the one listed are shown, not entered

# The kinds of refusal.
INVALID_PATH = "invalid_path"
MISSING = "missing"
TOO_LARGE = "too_large"
FULL = "full"
REFUSED = "refused"

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the workspace itself is ours
_WINDOW = 32  # directories a walk keeps open
_PASSES = 3  # how often a directory being removed is listed again for what was made meanwhile
_CHANGING_TRIES = 3


class Refused(Exception):
    """A request the workspace refuses, of a kind the host maps to its own typed error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def reply(self) -> dict[str, Any]:
        return {"refused": self.kind, "message": str(self)}


class TreeChanged(OSError):
    """A directory was moved while a walk was inside it."""


class Source:
    """What a stream sends the host, read a piece at a time as its credit allows."""

    def read(self, limit: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FileSource(Source):
    """A regular file's bytes, at most `cap` of them."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd = fd
        self.left = cap

    def read(self, limit: int) -> bytes:
        if self.left <= 0 or self.fd < 0:
            return b""
        data = os.read(self.fd, min(limit, self.left))
        self.left -= len(data)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BytesSource(Source):
    """Bytes made at once (a listing), sent as the credit allows."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def read(self, limit: int) -> bytes:
        piece = self.data[self.at : self.at + limit]
        self.at += len(piece)
        return piece

    def close(self) -> None:
        self.data = b""


class FileSink:
    """A file being written from a stream: a temporary file beside it, renamed over it at the
    end, removed if the write fails or is given up."""

    def __init__(self, dfd: int, name: str, temp: str, fd: int, shown: str, mode: int) -> None:
        self.dfd = dfd
        self.name = name
        self.temp: str | None = temp
        self.fd = fd
        self.shown = shown
        self.mode = mode

    @property
    def done(self) -> bool:
        return self.fd < 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.close()
            raise _refusal(exc, f"cannot write {self.shown!r}") from None

    def finish(self) -> dict[str, Any]:
        """Put the file in its place; its entry."""
        assert self.temp is not None
        try:
            os.fchmod(self.fd, self.mode)
            # On its disk before it is answered: a machine that dies after an upload (its
            # kernel hung, say) keeps what the caller was told was written.
            os.fsync(self.fd)
            os.rename(self.temp, self.name, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            os.fsync(self.dfd)
            self.temp = None
            st = os.fstat(self.fd)
        except OSError as exc:
            raise _refusal(exc, f"cannot write {self.shown!r}") from None
        finally:
            self.close()
        return {"entry": _entry(self.shown, st, False)}

    def close(self) -> None:
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        if self.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temp, dir_fd=self.dfd)
            self.temp = None
        os.close(self.dfd)


# --- requests ----------------------------------------------------------------------------------
def open_file(root: str, path: object, max_bytes: int) -> tuple[FileSource, int]:
    """The regular file at `path`, refused if over `max_bytes`; its source and its size."""
    parts = split_path(path)
    dfd = _open_dir(root, parts[:-1])
    try:
        fd = _open_regular(dfd, parts[-1])
    finally:
        os.close(dfd)
    size = os.fstat(fd).st_size
    if size > max_bytes:
        os.close(fd)
        raise Refused(TOO_LARGE, f"{path!r} is {size} bytes; the limit is {max_bytes}")
    return FileSource(fd, max_bytes + 1), size


def open_sink(root: str, path: object, uid: int, gid: int, mode: int | None) -> FileSink:
    """Where the bytes for `path` go until they are all there."""
    parts = split_path(path)
    shown, name = "/".join(parts), parts[-1]
    dfd = _open_dir(root, parts[:-1], owner=(uid, gid))
    try:
        try:
            st: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
            raise Refused(REFUSED, f"cannot write {shown!r}: {_not_plain(st)}")
        if mode is None:
            mode = 0o644 if st is None else stat.S_IMODE(st.st_mode)
        temp = f".cir-upload-{os.urandom(8).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600, dir_fd=dfd)
        try:
            os.fchown(fd, uid, gid)
        except BaseException:
            os.close(fd)
            os.unlink(temp, dir_fd=dfd)
            raise
    except OSError as exc:
        os.close(dfd)
        raise _refusal(exc, f"cannot write {shown!r}") from None
    except BaseException:
        os.close(dfd)
        raise
    return FileSink(dfd, name, temp, fd, shown, mode & 0o777)


def listing(root: str, path: object, recursive: bool, limit: int) -> tuple[BytesSource, int, bool]:
    """The entries under `path`, depth first, sorted within each directory, one JSON line
    each; how many, and whether more were left out (`limit` or MAX_LIST_BYTES)."""
    top = split_path(path, allow_root=True)
    out = bytearray()
    count, truncated = 0, False
    top_fd = _open_dir(root, top)
    walk = _Walk(top_fd)
    try:
        pending = [_sorted_names(top_fd, path)]
        prefixes = [("/".join(top), False)]  # shown path, and whether it was escaped
        while pending:
            if not pending[-1]:
                pending.pop()
                prefixes.pop()
                if walk.depth:
                    walk.pop()
                continue
            if count >= limit:
                truncated = True
                break
            name = pending[-1].pop()
            prefix, escaped = prefixes[-1]
            shown, name_escaped = shown_name(name)
            rel = f"{prefix}/{shown}" if prefix else shown
            try:
                st = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            entry = _entry(rel, st, escaped or name_escaped)
            line = json.dumps(entry).encode() + b"\n"
            if len(out) + len(line) > MAX_LIST_BYTES:
                truncated = True
                break
            out += line
            count += 1
            if recursive and entry["kind"] == "directory" and walk.depth < MAX_LIST_DEPTH:
                try:
                    walk.push(name)
                except OSError:
                    continue  # no longer a directory
                try:
                    pending.append(_sorted_names(walk.fd, rel))
                except Refused:
                    walk.pop()
                    continue
                prefixes.append((rel, entry["escaped"]))
    except TreeChanged:
        raise Refused(REFUSED, f"{path!r} changed while it was listed; try again") from None
    except OSError as exc:
        raise _refusal(exc, f"cannot list {path!r}") from None
    finally:
        walk.close()
        os.close(top_fd)
    return BytesSource(bytes(out)), count, truncated


def remove(root: str, path: object) -> None:
    """Remove a file, a symlink (never what it points at) or a directory tree of any depth."""
    parts = split_path(path)
    dfd = _open_dir(root, parts[:-1])
    try:
        _remove_tree(dfd, parts[-1])
    except FileNotFoundError:
        raise Refused(MISSING, f"no such file: {path!r}") from None
    except OSError as exc:
        raise _refusal(exc, f"cannot remove {path!r}") from None
    finally:
        os.close(dfd)


def make_dir(root: str, path: object, uid: int, gid: int) -> dict[str, Any]:
    """The directory at `path` (and its parents) made if missing, given to uid:gid."""
    parts = split_path(path)
    fd = _open_dir(root, parts, owner=(uid, gid))
    try:
        return {"entry": _entry("/".join(parts), os.fstat(fd), False)}
    finally:
        os.close(fd)


def stat_path(root: str, path: object) -> dict[str, Any]:
    """What is at `path` (a symlink itself, not what it points at)."""
    parts = split_path(path, allow_root=True)
    dfd = _open_dir(root, parts[:-1])
    try:
        if not parts:
            return {"entry": _entry("", os.fstat(dfd), False)}
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            raise _refusal(exc, f"cannot look at {path!r}") from None
        return {"entry": _entry("/".join(parts), st, False)}
    finally:
        os.close(dfd)


# --- paths -------------------------------------------------------------------------------------
def split_path(path: object, *, allow_root: bool = False) -> tuple[str, ...]:
    """A workspace-relative path in safe components (workspace_paths.clean_path's rules)."""
    if not isinstance(path, str):
        raise Refused(INVALID_PATH, "the path is not a string")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise Refused(INVALID_PATH, "the path contains a NUL byte or a control character")
    if path.startswith("/") or path.startswith("\\"):
        raise Refused(INVALID_PATH, f"{path!r} is absolute: give a path relative to the workspace")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise Refused(INVALID_PATH, f"{path!r} contains '..': paths must stay inside the workspace")
    if any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
        raise Refused(INVALID_PATH, "a path component is longer than 255 bytes")
    if not parts and not allow_root:
        raise Refused(INVALID_PATH, "the path is empty")
    return parts


def shown_name(name: str) -> tuple[str, bool]:
    """A name as listed: itself when it is valid UTF-8, else its bytes with \\xNN escapes, and
    whether it was escaped (workspace_files.shown_name)."""
    if name.isascii():
        return name, False
    try:
        name.encode()
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "backslashreplace"), True
    return name, False


def _open_dir(root: str, parts: tuple[str, ...], *, owner: tuple[int, int] | None = None) -> int:
    """The directory `parts` below the workspace, each one opened from its parent's descriptor
    and never through a symlink; made (and given to `owner`) where missing if `owner` is set."""
    try:
        fd = os.open(root, _ROOT_FLAGS)
    except OSError as exc:
        raise Refused(REFUSED, f"the workspace cannot be opened: {_why(exc)}") from None
    try:
        for part in parts:
            nxt = _step(fd, part, owner)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(fd: int, part: str, owner: tuple[int, int] | None) -> int:
    for _ in range(_CHANGING_TRIES):  # the sandbox may be changing the directory meanwhile
        try:
            return os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if owner is None:
                raise Refused(MISSING, f"no such directory: {part!r}") from None
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _refusal(exc, f"cannot make the directory {part!r}") from None
            try:
                os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                raise _refusal(exc, f"cannot give the directory {part!r} away") from None
        except OSError as exc:
            why = _why(exc)
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    why = _why(OSError(errno.ELOOP, "a symlink"))  # O_DIRECTORY said ENOTDIR
            raise Refused(
                REFUSED, f"{part!r} is not a directory of the workspace ({why})"
            ) from None
    raise Refused(REFUSED, f"{part!r} keeps changing; try again")


def _open_regular(dfd: int, name: str) -> int:
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dfd)
    except FileNotFoundError:
        raise Refused(MISSING, f"no such file: {name!r}") from None
    except OSError as exc:
        raise Refused(REFUSED, f"cannot open {name!r}: {_why(exc)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(REFUSED, f"{name!r} {_not_plain(st)}")
    return fd


def _sorted_names(dfd: int, path: object) -> list[str]:
    """The directory's names in reverse order (the walk pops them from the end)."""
    try:
        return sorted(os.listdir(dfd), reverse=True)
    except OSError as exc:
        raise Refused(REFUSED, f"cannot list {path!r}: {_why(exc)}") from None


def _entry(path: str, st: os.stat_result, escaped: bool) -> dict[str, Any]:
    mode = st.st_mode
    kind = (
        "directory"
        if stat.S_ISDIR(mode)
        else "file"
        if stat.S_ISREG(mode)
        else "symlink"
        if stat.S_ISLNK(mode)
        else "other"
    )
    size = st.st_size if kind == "file" else 0
    return {"path": path, "kind": kind, "size": size, "mtime": st.st_mtime, "escaped": escaped}


def _not_plain(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink, and symlinks are never followed"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if stat.S_ISREG(st.st_mode):
        return "has other hard links"
    return "is not a plain file"


def _refusal(exc: OSError, what: str) -> Refused:
    if exc.errno == errno.ENOENT:
        return Refused(MISSING, f"{what}: it is missing")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Refused(FULL, f"{what}: the workspace is full ({exc.strerror})")
    if exc.errno == errno.EFBIG:
        return Refused(TOO_LARGE, f"{what}: {exc.strerror}")
    return Refused(REFUSED, f"{what}: {_why(exc)}")


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symlink, and symlinks are never followed"
    if exc.errno == errno.EISDIR:
        return "it is a directory"
    return exc.strerror or str(exc)


# --- walking trees (sandbox/dir_stack.py and sandbox/tree_removal.py, which the agent cannot
# import) -------------------------------------------------------------------------------------
class _Level:
    __slots__ = ("device", "fd", "inode", "name")

    def __init__(self, name: str, fd: int, device: int, inode: int) -> None:
        self.name = name
        self.fd: int | None = fd  # None once it has left the window
        self.device = device
        self.inode = inode


class _Walk:
    """The open directories from a top one (borrowed) down: only the deepest `_WINDOW` stay
    open, so a tree thousands deep cannot exhaust descriptors; going back up to a closed one
    reopens it through '..', checked to be the very directory that was left."""

    def __init__(self, top_fd: int) -> None:
        self.top_fd = top_fd
        self.levels: list[_Level] = []

    @property
    def depth(self) -> int:
        return len(self.levels)

    @property
    def fd(self) -> int:
        if not self.levels:
            return self.top_fd
        fd = self.levels[-1].fd
        assert fd is not None
        return fd

    def push(self, name: str) -> None:
        fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        st = os.fstat(fd)
        self.levels.append(_Level(name, fd, st.st_dev, st.st_ino))
        leaving = len(self.levels) - 1 - _WINDOW
        if leaving >= 0:
            old = self.levels[leaving].fd
            if old is not None:
                os.close(old)
                self.levels[leaving].fd = None

    def pop(self) -> str:
        child = self.levels.pop()
        assert child.fd is not None
        try:
            parent = self.levels[-1] if self.levels else None
            if parent is not None and parent.fd is None:
                fd = os.open("..", DIR_FLAGS, dir_fd=child.fd)
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (parent.device, parent.inode):
                    os.close(fd)
                    raise TreeChanged(f"the directory {parent.name!r} was moved during the walk")
                parent.fd = fd
        finally:
            os.close(child.fd)
        return child.name

    def close(self) -> None:
        while self.levels:
            fd = self.levels.pop().fd
            if fd is not None:
                os.close(fd)


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove `name` in `parent_fd` and all below it, iteratively; goes on past what it cannot
    remove, and raises the first error if the tree is still there at the end."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    errors: list[OSError] = []
    walk = _Walk(parent_fd)
    try:
        walk.push(name)
        pending = [os.listdir(walk.fd)]
        passes = [1]
        while pending:
            names = pending[-1]
            if names:
                entry = names.pop()
                try:
                    st = os.stat(entry, dir_fd=walk.fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        walk.push(entry)
                        try:
                            pending.append(os.listdir(walk.fd))
                        except OSError:
                            walk.pop()
                            raise
                        passes.append(1)
                    else:
                        os.unlink(entry, dir_fd=walk.fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    errors.append(exc)
                continue
            if passes[-1] < _PASSES:
                again = os.listdir(walk.fd)
                if again:  # made while this directory was being emptied
                    pending[-1] = again
                    passes[-1] += 1
                    continue
            pending.pop()
            passes.pop()
            done = walk.pop()
            try:
                os.rmdir(done, dir_fd=walk.fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if walk.depth == 0:  # the tree itself is still there: say why
                    raise (errors[0] if errors else exc) from None
                errors.append(exc)
    finally:
        walk.close()
