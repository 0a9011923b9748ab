"""Builds the kernel images without any container registry.

1. The base: Debian bookworm from the Debian mirror with debootstrap, turned into an image with
   `docker import` (about a minute, once).
2. The kernel image: `Dockerfile` beside this file on that base, with the wheels of the
   project's `kernel` and `data` extras downloaded on the host first and installed offline in
   the image, and Chromium (for plotly's PNG export) from the Debian mirror.
3. The full image: `Dockerfile.full` on the kernel image, adding the kernels of every other
   language: R and Java from the Debian mirror, Deno and jjava (the `languages` extra) as wheels.

Builds that install Debian packages run with host networking: there is no registry, but the
host reaches the Debian mirror. Each image carries a label with the hash of what it was built
from; when nothing changed, a rebuild is a look-up that takes well under a second.
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

from sandbox.image_labels import (
    FULL_IMAGE,
    FULL_IMAGE_LANGUAGES,
    IMAGE_ROLE_LABEL,
    KERNEL_IMAGE,
    KERNEL_IMAGE_LANGUAGES,
    LANGUAGES_LABEL,
    languages_label,
)
from sandbox.kernel.command import KERNEL_START_FILES

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Preloaded in the kernel images: `stat` and `ls -l` under gVisor (the file says why).
STATX_SHIM = HERE / "statx_flags.c"
BASE_IMAGE = "code-interpreter-base:bookworm"
HASH_LABEL = "code-interpreter.build-hash"
ROLE_LABEL = IMAGE_ROLE_LABEL
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What commands in a sandbox expect beside Python: git (E2B's git API, agents' repos) and ps.
BASE_PACKAGES = ["python3", "python3-venv", "passwd", "ca-certificates", "git", "procps"]
CACHE_DIR = Path.home() / ".cache" / "code-interpreter" / "wheels"
# The extras each image installs, on top of the image it is built on.
KERNEL_IMAGE_EXTRAS = ("kernel", "data")
FULL_IMAGE_EXTRAS = ("languages",)
# Wheels for the images' Python (bookworm's 3.11, glibc 2.36): every manylinux tag up to 2.36;
# pip matches an explicit --platform literally, so each is named.
WHEEL_PLATFORMS = [
    "manylinux2014_x86_64",
    *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)),
]


@dataclass
class Built:
    tag: str
    image_id: str
    cached: bool


def extra_requirements(*extras: str) -> list[str]:
    """The requirements of these extras of this project, read from pyproject.toml (the single
    list of what each image holds) or, installed without the source tree, from its metadata."""
    pyproject = HERE.parent / "pyproject.toml"
    if pyproject.exists():
        table = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
        return [requirement for extra in extras for requirement in table[extra]]
    requires = metadata.requires("code-interpreter-runtime") or []
    return [
        r.split(";")[0].strip() for extra in extras for r in requires if f'extra == "{extra}"' in r
    ]


def kernel_requirements() -> list[str]:
    """What the kernel image installs: the `kernel` and `data` extras."""
    return extra_requirements(*KERNEL_IMAGE_EXTRAS)


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


def _stage_wheels(requirements: str, context: Path) -> None:
    """Put the wheels these requirements resolve to into the build context's `wheels`.

    They are downloaded into a cache on the host first (so a rebuild downloads nothing new),
    then resolved again from that cache alone, so the context holds only what is needed."""
    (context / "requirements.txt").write_text(requirements)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    target = [
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        *(arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)),
        "-r",
        str(context / "requirements.txt"),
    ]
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    log.info("downloading wheels into %s", CACHE_DIR)
    subprocess.run([*pip, *target, "-d", str(CACHE_DIR)], check=True)
    subprocess.run(
        [
            *pip,
            *target,
            "--no-index",
            "--find-links",
            str(CACHE_DIR),
            "-d",
            str(context / "wheels"),
        ],
        check=True,
    )


def _build(
    client: docker.DockerClient,
    *,
    tag: str,
    dockerfile: bytes,
    requirements: str,
    buildargs: dict[str, str],
    labels: dict[str, str],
    files: dict[str, Path],
) -> str:
    """`docker build` of one image, with host networking so apt reaches the Debian mirror."""
    with tempfile.TemporaryDirectory(prefix="cir-build-") as tmp:
        context = Path(tmp)
        (context / "Dockerfile").write_bytes(dockerfile)
        for name, source in files.items():
            shutil.copy(source, context / name)
        _stage_wheels(requirements, context)
        log.info("building %s", tag)
        image, _ = client.images.build(
            path=str(context),
            tag=tag,
            rm=True,
            forcerm=True,
            network_mode="host",
            buildargs=buildargs,
            labels=labels,
        )
    return str(image.id)


def _requirements_file(*extras: str) -> str:
    return "\n".join(extra_requirements(*extras)) + "\n"


def kernel_digest(client: docker.DockerClient, *, base_image: str = BASE_IMAGE) -> str:
    """The hash of what the kernel image is built from: equal to its label, nothing changed."""
    return _digest(
        (HERE / "Dockerfile").read_bytes(),
        _requirements_file(*KERNEL_IMAGE_EXTRAS),
        *(host.read_bytes() for host, _ in KERNEL_START_FILES),
        STATX_SHIM.read_bytes(),
        client.images.get(base_image).id,
    )


def full_digest(client: docker.DockerClient, *, kernel_image: str = KERNEL_IMAGE) -> str:
    """The hash of what the full image is built from, the kernel image included."""
    return _digest(
        (HERE / "Dockerfile.full").read_bytes(),
        _requirements_file(*FULL_IMAGE_EXTRAS),
        client.images.get(kernel_image).id,
    )


def build_kernel(
    client: docker.DockerClient, *, base_image: str = BASE_IMAGE, tag: str = KERNEL_IMAGE
) -> Built:
    """The data-analysis image every session gets unless it asks for another."""
    requirements = _requirements_file(*KERNEL_IMAGE_EXTRAS)
    dockerfile = (HERE / "Dockerfile").read_bytes()
    digest = kernel_digest(client, base_image=base_image)
    found = _existing(client, tag, digest)
    if found:
        return Built(tag, found, cached=True)
    image_id = _build(
        client,
        tag=tag,
        dockerfile=dockerfile,
        requirements=requirements,
        buildargs={"BASE_IMAGE": base_image},
        labels={
            HASH_LABEL: digest,
            ROLE_LABEL: "kernel",
            LANGUAGES_LABEL: languages_label(KERNEL_IMAGE_LANGUAGES),
        },
        files={
            **{host.name: host for host, _ in KERNEL_START_FILES},
            STATX_SHIM.name: STATX_SHIM,
        },
    )
    return Built(tag, image_id, cached=False)


def build_full(
    client: docker.DockerClient, *, kernel_image: str = KERNEL_IMAGE, tag: str = FULL_IMAGE
) -> Built:
    """The kernel image plus every other language's kernel (sessions ask for it by name)."""
    requirements = _requirements_file(*FULL_IMAGE_EXTRAS)
    dockerfile = (HERE / "Dockerfile.full").read_bytes()
    digest = full_digest(client, kernel_image=kernel_image)
    found = _existing(client, tag, digest)
    if found:
        return Built(tag, found, cached=True)
    image_id = _build(
        client,
        tag=tag,
        dockerfile=dockerfile,
        requirements=requirements,
        buildargs={"KERNEL_IMAGE": kernel_image},
        labels={
            HASH_LABEL: digest,
            ROLE_LABEL: "full",
            LANGUAGES_LABEL: languages_label(FULL_IMAGE_LANGUAGES),
        },
        files={},
    )
    return Built(tag, image_id, cached=False)


def build_all(*, base_image: str | None = None) -> list[Built]:
    """Build (or find) the base, the kernel and the full image. `base_image` skips debootstrap."""
    client = docker.from_env()
    built = [] if base_image else [build_base(client)]
    built.append(build_kernel(client, base_image=base_image or BASE_IMAGE))
    built.append(build_full(client))
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
