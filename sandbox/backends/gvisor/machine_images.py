"""Saved machines on disk, and what a machine restored from a shared one must change.

A saved machine is a directory: gVisor's checkpoint `image/`, a copy of the `workspace/`, and a
`manifest.json` (the kernel image, the uid its processes run as, its kernels and processes,
the runsc that saved it). Three kinds share that form: a paused session's machine (restored
once, then gone), a named snapshot (restored as often as asked: forks) and a template (a
machine with modules imported, restored for each new session of its spec).

A machine restored from a save others are restored from too starts with their secrets and
their random streams: `rekey_code` is what its Python kernel runs before any code of the
session does (docs/gvisor.md, "Templates and forks").
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import SandboxSpec, mount_places
from sandbox.backends.gvisor.machine import AGENT_FILES, SUDO_FILE, ImageUnusable
from sandbox.egress_channel import FORWARDER_FILE
from sandbox.host_channel import KERNEL_MODULE
from sandbox.kernel.command import KERNEL_START_FILES
from sandbox.kernel.programs import SUPERVISOR_FILE

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20


def write_manifest(where: Path, manifest: dict[str, Any]) -> None:
    (where / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, **manifest}))


def read_manifest(where: Path, runsc: str) -> dict[str, Any]:
    """The manifest of the saved machine in `where`, if this host's runsc can restore it."""
    try:
        with (where / MANIFEST).open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError("over 1 MiB")
        manifest = json.loads(data)
        if not isinstance(manifest, dict):
            raise ValueError("not an object")
        int(manifest["uid"])
        str(manifest["image"])
        if not isinstance(manifest.get("kernels"), dict):
            raise ValueError("no kernels")
        if not isinstance(manifest.get("processes", []), list):
            raise ValueError("no processes")
        saved_volume_places(manifest)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ImageUnusable(f"the saved machine has no readable manifest: {exc}") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise ImageUnusable("the saved machine was saved by another version of this service")
    if manifest.get("runsc") != runsc:
        raise ImageUnusable(
            f"the saved machine was saved by gVisor {manifest.get('runsc')}, this host runs {runsc}"
        )
    return manifest


def saved_volume_places(manifest: dict[str, Any]) -> list[tuple[str, bool]]:
    """`volume_places` as the manifest keeps them (none in a save from before volumes);
    ValueError, KeyError or TypeError if it holds something else."""
    entries = manifest.get("volumes")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError("volumes: not a list")
    places = []
    for entry in entries:
        path, read_only = entry["path"], entry["read_only"]
        if not isinstance(path, str) or not isinstance(read_only, bool):
            raise ValueError("volumes: an entry is not a path and a flag")
        places.append((path, read_only))
    return sorted(places)


def volume_places(spec: SandboxSpec) -> list[tuple[str, bool]]:
    """Where a machine's volumes are mounted, and whether read-only: what a saved machine's
    manifest keeps, and a sandbox restored from it must mount the same (its mount table is the
    saved one; the host directories may be others, the same volumes made ready again)."""
    return mount_places(spec.mounts)


@functools.cache
def inside_code_digest() -> str:
    """Our code a machine runs inside (its agent and the modules beside it, start-up files,
    supervisor, forwarder, the tools' module, the re-key code): a template made with other code
    is not this service's."""
    digest = hashlib.sha256(f"{MANIFEST_VERSION}\n{_PYTHON_REKEY}".encode())
    for path in (
        *(host for host, _ in AGENT_FILES),
        *(host for host, _ in KERNEL_START_FILES),
        SUPERVISOR_FILE,
        FORWARDER_FILE,
        SUDO_FILE,
        KERNEL_MODULE,
    ):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def template_key(rootfs: Path, spec: SandboxSpec, preload: str) -> str:
    """What a template is made for: the image's root filesystem (by image id), what of the
    spec its machine holds (limits, environment, working directory, host tools), the preload
    and our code inside."""
    held = spec.model_dump(mode="json", include={"limits", "env", "workdir", "host_tools"})
    image_id = rootfs.parent.name  # `<store>/<image id>/rootfs` (unpack_rootfs)
    text = json.dumps([image_id, held, preload, inside_code_digest()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# Run silently in a namespace of its own, so the session's is untouched; the key is set last,
# so a failure before it leaves the old one (`KernelDriver.rekey`). The connection file inside
# is rewritten too: it would still show the key every sibling was restored with.
_PYTHON_REKEY = """\
exec('''
import json, random, sys, tempfile, uuid
random.seed()
if "numpy" in sys.modules:
    sys.modules["numpy"].random.seed()
tempfile._name_sequence = None
kernel = get_ipython().kernel
try:
    from ipykernel.kernelapp import IPKernelApp
    path = IPKernelApp.instance().connection_file
    with open(path) as f:
        info = json.load(f)
    info["key"] = {key!r}
    with open(path, "w") as f:
        json.dump(info, f)
except Exception:
    pass
kernel.session.session = str(uuid.uuid4())
kernel.session.key = {key!r}.encode()
''', {{"get_ipython": get_ipython}})
"""


def rekey_code(language: str, key: str) -> str | None:
    """The code by which a restored kernel of `language` takes `key` and reseeds its random
    streams; None for a language whose kernel cannot change its key as it runs."""
    if language != PYTHON:
        return None
    return _PYTHON_REKEY.format(key=key)
