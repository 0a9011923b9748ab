"""A Debian package and a flat apt repository for it, made here (no dpkg-deb, no mirror), so
a sandbox's `sudo apt-get install` can be tested against the loopback internet."""

from __future__ import annotations

import hashlib
import io
import tarfile
from email.utils import formatdate

DEB_PACKAGE = "cirdemo"
DEB_FILE = f"{DEB_PACKAGE}_1.0_all.deb"
DEB_INSTALLS = f"/usr/share/{DEB_PACKAGE}/hello"
DEB_SAYS = b"installed by apt through the egress proxy\n"


def _tar_gz(files: dict[str, tuple[bytes, int]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.GNU_FORMAT) as archive:
        dirs: set[str] = set()
        for name in files:
            parts = name.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:depth]))
        for directory in sorted(dirs):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            archive.addfile(info)
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    """The `ar` archive a .deb is: a magic line, then each member's 60-byte header and data."""
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        header = (
            f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}".encode() + b"`\n"
        )
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def build_deb() -> bytes:
    control = (
        f"Package: {DEB_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: tests <tests@example.org>\nDescription: a package for the tests\n"
    ).encode()
    return _ar(
        [
            ("debian-binary", b"2.0\n"),
            ("control.tar.gz", _tar_gz({"./control": (control, 0o644)})),
            ("data.tar.gz", _tar_gz({"." + DEB_INSTALLS: (DEB_SAYS, 0o644)})),
        ]
    )


def flat_repository(deb: bytes) -> dict[str, bytes]:
    """The files of `deb [trusted=yes] http://HOST/apt ./`, by path under /apt."""
    packages = (
        f"Package: {DEB_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
        f"Maintainer: tests <tests@example.org>\nFilename: ./{DEB_FILE}\nSize: {len(deb)}\n"
        f"SHA256: {hashlib.sha256(deb).hexdigest()}\nDescription: a package for the tests\n\n"
    ).encode()
    release = (
        "Origin: tests\nLabel: tests\nSuite: tests\nCodename: tests\nArchitectures: all amd64\n"
        f"Date: {formatdate(usegmt=True)}\nSHA256:\n"
        f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    ).encode()
    return {"Packages": packages, "Release": release, DEB_FILE: deb}
