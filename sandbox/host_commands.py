"""The host programs the service runs (bwrap, mount, umount), found once in fixed system places.

Neither a session's settings nor the service's own environment may choose which file the host
executes: a name is resolved to an absolute path from `TRUSTED_PATH` only, and every such program
starts with `HOST_ENVIRONMENT` and nothing else.
"""

from __future__ import annotations

import functools
import os
import shutil

from code_interpreter_wire.errors import BackendUnavailable

TRUSTED_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENVIRONMENT: dict[str, str] = {"PATH": TRUSTED_PATH, "LANG": "C.UTF-8"}


def resolve(program: str, hint: str = "") -> str:
    """The absolute path of `program`: as given when absolute, else looked up in TRUSTED_PATH."""
    if os.path.isabs(program):
        found = program if os.access(program, os.X_OK) and os.path.isfile(program) else None
    else:
        found = shutil.which(program, path=TRUSTED_PATH)
    if found is None:
        where = program if os.path.isabs(program) else f"{program!r} in {TRUSTED_PATH}"
        raise BackendUnavailable(f"cannot find the host program {where}. {hint}".strip())
    return os.path.realpath(found)


@functools.cache
def system_program(program: str) -> str:
    """`resolve` once per process, for programs every host has (mount, umount)."""
    return resolve(program)


def memfd_with(name: str, data: bytes) -> int:
    """A file descriptor holding `data`, positioned at its start, for a child to read to its end
    (in memory: nothing lands on disk, nothing shows on a command line)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
