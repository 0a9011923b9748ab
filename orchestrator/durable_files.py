"""Files written so that a crash never leaves an empty or half one in place (the vault's keys
and CA, volumes' metadata): the data goes to a new temporary file beside it (created 0600,
exclusively), is synced, and only then gets the file's name; the directory is synced after."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_new(path: Path, data: bytes, mode: int, *, replace: bool = True) -> bool:
    """`data` written whole as `path` with `mode`. `replace=False`: an existing `path` is kept
    (and False answered), so two processes making it at once keep the first one's."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, mode)
        if replace:
            os.replace(temporary, path)
            placed = True
        else:
            placed = _link(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    _sync_directory(path.parent)
    return placed


def _link(temporary: str, path: Path) -> bool:
    """`temporary` linked as `path` unless that exists (atomically where hard links work)."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: checked, then renamed
        if path.exists():
            return False
        os.rename(temporary, path)
    return True


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse a directory's fsync
            os.fsync(fd)
    finally:
        os.close(fd)
