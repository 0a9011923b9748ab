"""Builds the kernel images without any container registry.

1. The base: Debian bookworm from the Debian mirror with debootstrap, turned into an image with
   `docker import` (about a minute, once).
2. The kernel image: the Dockerfile beside this file on that base, with the wheels of the
   project's `kernel` extra downloaded on the host first and installed offline in the image.

Each image carries a label with the hash of what it was built from; when nothing changed, a
rebuild is a look-up that takes well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import docker
from docker.errors import ImageNotFound

from sandbox.kernel.command import STARTUP_FILE

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
BASE_IMAGE = "code-interpreter-base:bookworm"
KERNEL_IMAGE = "code-interpreter-kernel:latest"
HASH_LABEL = "code-interpreter.build-hash"
ROLE_LABEL = "code-interpreter.image"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What commands in a sandbox expect beside Python: git (E2B's git API, agents' repos) and ps.
BASE_PACKAGES = ["python3", "python3-venv", "passwd", "ca-certificates", "git", "procps"]
CACHE_DIR = Path.home() / ".cache" / "code-interpreter" / "wheels"


@dataclass
class Built:
    tag: str
    image_id: str
    cached: bool


def kernel_requirements() -> list[str]:
    """The `kernel` extra of this project: what runs inside every sandbox."""
    pyproject = HERE.parent / "pyproject.toml"
    if pyproject.exists():
        extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
        return list(extras["kernel"])
    requires = metadata.requires("code-interpreter-runtime") or []
    return [r.split(";")[0].strip() for r in requires if 'extra == "kernel"' in r]


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _existing(client: docker.DockerClient, tag: str, digest: str) -> str | None:
    try:
        image = client.images.get(tag)
    except ImageNotFound:
        return None
    labels = image.labels or {}
    return str(image.id) if labels.get(HASH_LABEL) == digest else None


def build_base(client: docker.DockerClient, *, mirror: str = DEBIAN_MIRROR) -> Built:
    digest = _digest("bookworm", "minbase", *BASE_PACKAGES)
    found = _existing(client, BASE_IMAGE, digest)
    if found:
        return Built(BASE_IMAGE, found, cached=True)
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "debootstrap is needed to build the base image: apt-get install debootstrap"
        )
    with tempfile.TemporaryDirectory(prefix="cir-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log.info("debootstrap bookworm into %s", rootfs)
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                mirror,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        changes = [f"LABEL {HASH_LABEL}={digest}", f"LABEL {ROLE_LABEL}=base", 'CMD ["/bin/sh"]']
        imported = subprocess.run(
            ["docker", "import", *[f"--change={c}" for c in changes], "-", BASE_IMAGE],
            stdin=tar.stdout,
            check=True,
            capture_output=True,
            text=True,
        )
        tar.wait()
    image_id = imported.stdout.strip()
    return Built(BASE_IMAGE, image_id, cached=False)


def build_kernel(
    client: docker.DockerClient, *, base_image: str = BASE_IMAGE, tag: str = KERNEL_IMAGE
) -> Built:
    requirements = "\n".join(kernel_requirements()) + "\n"
    dockerfile = (HERE / "Dockerfile").read_bytes()
    base_id = client.images.get(base_image).id
    digest = _digest(dockerfile, requirements, STARTUP_FILE.read_bytes(), base_id)
    found = _existing(client, tag, digest)
    if found:
        return Built(tag, found, cached=True)
    with tempfile.TemporaryDirectory(prefix="cir-build-") as tmp:
        context = Path(tmp)
        (context / "Dockerfile").write_bytes(dockerfile)
        (context / "requirements.txt").write_text(requirements)
        shutil.copy(STARTUP_FILE, context / "startup.py")
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        log.info("downloading wheels into %s", CACHE_DIR)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux2014_x86_64",
                "--platform",
                "manylinux_2_28_x86_64",
                "--implementation",
                "cp",
                "-d",
                str(CACHE_DIR),
                "-r",
                str(context / "requirements.txt"),
            ],
            check=True,
        )
        shutil.copytree(CACHE_DIR, context / "wheels")
        log.info("building %s", tag)
        image, _ = client.images.build(
            path=str(context),
            tag=tag,
            rm=True,
            forcerm=True,
            buildargs={"BASE_IMAGE": base_image},
            labels={HASH_LABEL: digest, ROLE_LABEL: "kernel"},
        )
    return Built(tag, str(image.id), cached=False)


def build_all(*, base_image: str | None = None) -> list[Built]:
    """Build (or find) the base and the kernel image. `base_image` skips debootstrap."""
    client = docker.from_env()
    built = [] if base_image else [build_base(client)]
    built.append(build_kernel(client, base_image=base_image or BASE_IMAGE))
    return built


def list_images() -> list[dict[str, str]]:
    client = docker.from_env()
    out = []
    for image in client.images.list(filters={"label": ROLE_LABEL, "dangling": False}):
        labels = image.labels or {}
        out.append(
            {
                "tags": ", ".join(image.tags) or "<none>",
                "role": labels.get(ROLE_LABEL, ""),
                "id": image.short_id.removeprefix("sha256:"),
                "size_mb": f"{(image.attrs.get('Size') or 0) / 1e6:.0f}",
                "created": str(image.attrs.get("Created", ""))[:19],
            }
        )
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for b in build_all(base_image=sys.argv[1] if len(sys.argv) > 1 else None):
        print(f"{b.tag} {b.image_id[:19]} {'(cached)' if b.cached else '(built)'}")
