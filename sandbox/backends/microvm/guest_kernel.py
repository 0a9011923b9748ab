"""The guest's kernel: Debian's cloud kernel, fetched once with apt and kept in the user's cache.

Why not installed as a package: installing `linux-image-cloud-amd64` on a host would make it a
kernel that host may boot (and run its initramfs and boot-loader hooks). We take the package's
files only: `apt-get download` (checked by apt against the archive's signed index, as any
install), then the kernel image, its config and the few modules a guest needs, out of the
package, into `<cache>/code-interpreter/microvm-kernel/<release>/`.

`python -m sandbox.backends.microvm.guest_kernel` fetches it (scripts/install-system-packages.sh
runs it where QEMU is installed); nothing is fetched when it is there already.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable

META_PACKAGE = "linux-image-cloud-amd64"
KERNEL_JSON = "kernel.json"
# What the guest's first steps load (guest_boot.py), each after what it needs (read from the
# module's own `depends=`): the virtio transports (PCI for q35, MMIO for the microvm machine),
# disks, the agent's port, the host's entropy, the root filesystem's overlay.
MODULES = ("virtio_pci", "virtio_mmio", "virtio_blk", "virtio_console", "virtio-rng", "overlay")
_MODULES_DIR = "lib/modules"


@dataclass(frozen=True)
class GuestKernel:
    """A fetched kernel: its image and its modules (file names by module name, in load order)."""

    directory: Path
    release: str
    modules: tuple[str, ...]  # load order

    @property
    def image(self) -> Path:
        return self.directory / "vmlinuz"

    def module_file(self, name: str) -> Path:
        return self.directory / "modules" / f"{name}.ko"


def default_dir() -> Path:
    """Where the kernel is kept: the user's cache, beside the wasm backend's Pyodide."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "code-interpreter" / "microvm-kernel"


def find(directory: Path | None = None) -> GuestKernel:
    """The newest fetched kernel under `directory`, or BackendUnavailable saying how to fetch."""
    directory = directory or default_dir()
    found: list[GuestKernel] = []
    if directory.is_dir():
        for release_dir in directory.iterdir():
            try:
                data = json.loads((release_dir / KERNEL_JSON).read_text())
                kernel = GuestKernel(release_dir, str(data["release"]), tuple(data["modules"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if kernel.image.is_file() and _holds_modules(release_dir):
                found.append(kernel)
    if not found:
        raise BackendUnavailable(
            f"no guest kernel in {directory}: run `python -m sandbox.backends.microvm.guest_kernel`"
            " (scripts/install-system-packages.sh does, docs/microvm.md)"
        )
    return max(found, key=lambda k: _release_key(k.release))


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", release))


def fetch(directory: Path | None = None) -> GuestKernel:
    """Download Debian's cloud kernel package with apt and keep what a guest needs of it."""
    directory = directory or default_dir()
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise BackendUnavailable("fetching the guest kernel needs apt-get and dpkg-deb (Debian)")
    with tempfile.TemporaryDirectory(prefix="cir-kernel-") as work_dir:
        work = Path(work_dir)
        os.chmod(work, 0o755)  # apt's download user writes here where it can
        meta = _download(META_PACKAGE, work)
        depends = _run(["dpkg-deb", "-f", str(meta), "Depends"]).strip()
        match = re.match(r"(linux-image-[^\s,(]+)", depends)
        if match is None:
            raise BackendUnavailable(f"{META_PACKAGE} names no kernel package: {depends!r}")
        package = _download(match.group(1), work)
        tree = work / "tree"
        _run(["dpkg-deb", "-x", str(package), str(tree)])
        images = sorted((tree / "boot").glob("vmlinuz-*"))
        if not images:
            raise BackendUnavailable(f"{package.name} holds no kernel image")
        release = images[-1].name.removeprefix("vmlinuz-")
        done = directory / release
        if _holds_modules(done):
            return find(directory)
        making = directory / f".{release}.partial"
        shutil.rmtree(making, ignore_errors=True)
        (making / "modules").mkdir(parents=True)
        shutil.copyfile(images[-1], making / "vmlinuz")
        shutil.copyfile(tree / "boot" / f"config-{release}", making / "config")
        order = _load_order(tree / _MODULES_DIR / release, MODULES)
        for name, path in order:
            shutil.copyfile(path, making / "modules" / f"{name}.ko")
        (making / KERNEL_JSON).write_text(
            json.dumps({"release": release, "modules": [n for n, _ in order]})
        )
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(done, ignore_errors=True)  # one from before, without all the modules
        os.rename(making, done)
    return find(directory)


def _holds_modules(release_dir: Path) -> bool:
    """Whether a fetched kernel has every module this version loads."""
    try:
        held = set(json.loads((release_dir / KERNEL_JSON).read_text())["modules"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return {name.replace("-", "_") for name in MODULES} <= {n.replace("-", "_") for n in held}


def _download(package: str, into: Path) -> Path:
    _run(["apt-get", "download", "-q", package], cwd=into)
    found = sorted(into.glob(f"{package}_*.deb"))
    if not found:
        raise BackendUnavailable(f"apt-get download {package} left no package")
    return found[-1]


def _run(argv: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BackendUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def _load_order(modules_root: Path, wanted: tuple[str, ...]) -> list[tuple[str, Path]]:
    """`wanted` and what they need, each after its dependencies (by the files' `depends=`)."""
    files = {p.name.removesuffix(".ko"): p for p in modules_root.rglob("*.ko")}
    order: list[tuple[str, Path]] = []
    seen: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        key = name if name in files else name.replace("-", "_")
        if key in seen:
            return
        if key not in files:
            raise BackendUnavailable(f"the kernel package has no module {name!r}")
        if key in trail:
            raise BackendUnavailable(f"the modules {trail} depend on each other")
        for needed in module_depends(files[key]):
            visit(needed, (*trail, key))
        seen.add(key)
        order.append((key, files[key]))

    for name in wanted:
        visit(name, ())
    return order


def module_depends(path: Path) -> list[str]:
    """The modules a module file says it needs (its .modinfo `depends=` field)."""
    match = re.search(rb"\x00depends=([^\x00]*)\x00", b"\x00" + path.read_bytes())
    if match is None or not match.group(1):
        return []
    return [name for name in match.group(1).decode().split(",") if name]


if __name__ == "__main__":
    kernel = fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"guest kernel {kernel.release} in {kernel.directory}")
