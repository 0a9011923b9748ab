"""An npm package and the registry documents for it, made here, so a sandbox's `npm install`
(and `sudo npm i -g`) can be tested against the loopback internet."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile

NPM_PACKAGE = "cirdemo"
NPM_VERSION = "1.0.0"
NPM_TARBALL = f"{NPM_PACKAGE}-{NPM_VERSION}.tgz"
NPM_SAYS = "installed by npm through the egress proxy"


def build_tarball() -> bytes:
    """The package as npm publishes it: `package/` with its manifest and a command."""
    manifest = {
        "name": NPM_PACKAGE,
        "version": NPM_VERSION,
        "bin": {NPM_PACKAGE: "cli.js"},
        "main": "cli.js",
    }
    files = {
        "package/package.json": json.dumps(manifest).encode(),
        "package/cli.js": f"#!/usr/bin/env node\nconsole.log({NPM_SAYS!r});\n".encode(),
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".js") else 0o644
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def registry_documents(base_url: str, tarball: bytes) -> dict[str, bytes]:
    """The registry's answers by path under its root (`npm --registry <base_url>/`): the
    package's document (its versions, where each tarball is and its digests) and the tarball."""
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    version = {
        "name": NPM_PACKAGE,
        "version": NPM_VERSION,
        "bin": {NPM_PACKAGE: "cli.js"},
        "dist": {
            "tarball": f"{base_url}/{NPM_PACKAGE}/-/{NPM_TARBALL}",
            "shasum": hashlib.sha1(tarball).hexdigest(),
            "integrity": integrity,
        },
    }
    document = {
        "name": NPM_PACKAGE,
        "dist-tags": {"latest": NPM_VERSION},
        "versions": {NPM_VERSION: version},
    }
    return {NPM_PACKAGE: json.dumps(document).encode(), f"{NPM_PACKAGE}/-/{NPM_TARBALL}": tarball}
