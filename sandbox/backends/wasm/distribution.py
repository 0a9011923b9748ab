"""The Pyodide distribution the wasm backend runs: which release, where it lives on this
machine, and how it gets there (`python -m sandbox.backends.wasm.distribution`, run by
`make install`).

The release is pinned with the integrity npm publishes for its tarball, and the tarball is
checked against it before a byte of it is unpacked: the files a sandbox runs are exactly
the ones published. Only what the backend loads is kept; packages beyond the standard library
come from a directory the operator gives (never from Pyodide's CDN: a sandbox fetches nothing).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx

from code_interpreter_wire.errors import SandboxStartError

VERSION = "314.0.7"
PYTHON_VERSION = "3.14"  # the CPython this release of Pyodide is
INTEGRITY = (  # npm's `dist.integrity` of the release
    "sha512-0YvXxEhfEdpLfb/XkM2BFAeMROq0iMUX2bzzH9pOttyMcWkwq+HbE5uyuGD82LN7y2q+"
    "SNvi/6V5JEsOlD2R1A=="
)
TARBALL = f"https://registry.npmjs.org/pyodide/-/pyodide-{VERSION}.tgz"
MAX_TARBALL_BYTES = 64 << 20
# What a sandbox loads: the loader, the interpreter, the standard library, the package index.
FILES = (
    "pyodide.mjs",
    "pyodide.asm.mjs",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
    "package.json",
)
DIR_ENV = "CODE_INTERPRETER_PYODIDE_DIR"
MARKER = ".cir-pyodide"  # in a directory this made: the release and its integrity


class PyodideMissing(SandboxStartError):
    """This machine has no Pyodide distribution where the wasm backend looks for one."""


def default_dir() -> Path:
    """Where `make install` puts the pinned release: the user's cache, one directory a
    release."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "code-interpreter" / f"pyodide-{VERSION}"


def configured_dir() -> Path:
    """The distribution the backend runs: `CODE_INTERPRETER_PYODIDE_DIR`, else the default."""
    given = os.environ.get(DIR_ENV)
    return Path(given) if given else default_dir()


def check(directory: Path) -> Path:
    """`directory` if it holds a whole distribution, else PyodideMissing saying what to do."""
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise PyodideMissing(
            f"no Pyodide distribution in {directory} (missing {', '.join(missing)}): run "
            "`make install`, or `python -m sandbox.backends.wasm.distribution`, or point "
            f"{DIR_ENV} at one"
        )
    return directory


def verified(tarball: bytes) -> bytes:
    """The tarball, if it is the pinned release's; else ValueError."""
    algorithm, _, expected = INTEGRITY.partition("-")
    digest = base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode()
    if digest != expected:
        raise ValueError(f"the Pyodide {VERSION} tarball does not match its published integrity")
    return tarball


def unpack(tarball: bytes, directory: Path) -> Path:
    """Unpack the files the backend loads into `directory` (made whole, or not at all)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pyodide-", dir=directory.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(verified(tarball)), mode="r:gz") as archive:
            wanted = {f"package/{name}": name for name in FILES}
            for member in archive.getmembers():
                name = wanted.get(member.name)
                if name is None or not member.isfile():
                    continue
                source = archive.extractfile(member)
                if source is None:
                    continue
                with source, open(staging / name, "wb") as out:
                    shutil.copyfileobj(source, out)
        check(staging)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        (staging / MARKER).write_text(f"{VERSION} {INTEGRITY}\n")
        if directory.exists():  # only one this made: never a directory an operator named
            if not (directory / MARKER).is_file():
                raise ValueError(
                    f"{directory} exists and is no Pyodide this installer made: remove it, or "
                    "fetch into another directory"
                )
            aside = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(aside, ignore_errors=True)
            directory.rename(aside)
            staging.rename(directory)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def fetch(directory: Path) -> Path:
    """The pinned release in `directory`, downloaded from npm's registry if not there yet."""
    try:
        return check(directory)
    except PyodideMissing:
        pass
    with httpx.stream("GET", TARBALL, follow_redirects=True, timeout=120) as response:
        response.raise_for_status()
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_TARBALL_BYTES:
                raise ValueError(f"the Pyodide tarball is over {MAX_TARBALL_BYTES} bytes")
    return unpack(bytes(body), directory)


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else configured_dir()))
