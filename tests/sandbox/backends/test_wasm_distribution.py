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


def test_an_existing_directory_it_did_not_make_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pointed at an operator's own directory, the installer refuses before touching it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    tarball = _tarball({f"package/{name}": b"x" for name in distribution.FILES})
    monkeypatch.setattr(distribution, "INTEGRITY", _integrity_of(tarball))  # this one's
    with pytest.raises(ValueError, match="no Pyodide this installer made"):
        distribution.unpack(tarball, mine)
    made = distribution.unpack(tarball, tmp_path / "fresh")  # and one it made, it replaces
    assert distribution.unpack(tarball, made) == made
    assert (mine / "notes.txt").read_text() == "keep"


def _integrity_of(tarball: bytes) -> str:
    import base64
    import hashlib

    return "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
