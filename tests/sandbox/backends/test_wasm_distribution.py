"""The Pyodide the wasm backend runs is the pinned release, byte for byte: a tarball that does
not match the published integrity is refused before anything of it is unpacked, and a
directory missing a file says what to run."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from sandbox.backends.wasm import distribution


def _tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_tarball_other_than_the_pinned_one_is_refused_unopened(tmp_path: Path) -> None:
    forged = _tarball({f"package/{name}": b"x" for name in distribution.FILES})
    with pytest.raises(ValueError, match="does not match its published integrity"):
        distribution.unpack(forged, tmp_path / "pyodide")
    assert not (tmp_path / "pyodide").exists()
    assert list(tmp_path.iterdir()) == []  # no staging left either


def test_a_directory_missing_a_file_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "pyodide.mjs").write_text("")
    with pytest.raises(distribution.PyodideMissing, match="make install") as missing:
        distribution.check(tmp_path)
    assert "pyodide.asm.wasm" in str(missing.value)


def test_the_installed_release_is_whole() -> None:
    """What `make install` fetched (the wasm tests run on it)."""
    directory = distribution.configured_dir()
    assert distribution.check(directory) == directory
