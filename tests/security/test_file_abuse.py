"""Workspace trees built to break the host's file handling: names that are not UTF-8, and
directories nested deeper than Python's recursion limit and PATH_MAX."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox import Sandbox
from sandbox.kernel.connection import reset_kernel_dir
from sandbox.state_dir import SessionDirs

DEPTH = 3000  # deeper than the recursion limit (1,000) and, as paths, than PATH_MAX (4,096)


def build_deep_tree(name: str, depth: int = DEPTH) -> str:
    """Code that makes `name/d/d/.../d` `depth` deep, a file in each level, one chdir at a time
    (a path that long cannot be given to mkdir)."""
    return (
        "import os\n"
        "base = os.getcwd()\n"
        f"os.mkdir({name!r}); os.chdir({name!r})\n"
        f"for i in range({depth}):\n"
        "    open('f', 'w').close(); os.mkdir('d'); os.chdir('d')\n"
        "os.chdir(base)\n"
    )


def plant_deep_tree(parent: Path, name: str, depth: int = DEPTH) -> None:
    """The same tree, made on the host (where the kernel directory is only ours to write)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in [name] + ["d"] * depth:
            os.mkdir(level, dir_fd=fd)
            nxt = os.open(level, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


async def test_a_tree_deeper_than_the_recursion_limit_is_removed(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(build_deep_tree("deep"))
    assert ex.ok, ex.error
    await sandbox.remove_file("deep")
    assert await sandbox.list_files() == []
    check = await sandbox.execute("import os; os.path.exists('deep')")
    assert check.text == "False"


async def test_a_deep_listing_is_complete_and_in_tree_order(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(build_deep_tree("deep", 1500))
    assert ex.ok, ex.error
    entries = await sandbox.list_files("deep", recursive=True)
    assert len(entries) == 3000
    assert [e.path for e in entries[:3]] == ["deep/d", "deep/d/d", "deep/d/d/d"]
    paths = [e.path for e in entries]
    deepest = "deep" + "/d" * 1500
    assert paths[1499] == deepest and paths[1500] == deepest[:-2] + "/f"  # down, then back up
    assert paths[-1] == "deep/f"


async def test_names_that_are_not_utf8_are_listed_escaped(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "import os\n"
        "os.mkdir(b'caf\\xe9'); open(b'caf\\xe9/na\\xefve.txt', 'w').write('x')\n"
        "open('plain.txt', 'w').write('y')"
    )
    assert ex.ok, ex.error
    entries = {e.path: e for e in await sandbox.list_files(recursive=True)}
    assert set(entries) == {"caf\\xe9", "caf\\xe9/na\\xefve.txt", "plain.txt"}
    assert entries["caf\\xe9"].name_escaped and entries["caf\\xe9/na\\xefve.txt"].name_escaped
    assert not entries["plain.txt"].name_escaped
    for entry in entries.values():
        entry.model_dump_json()  # every entry can be sent as JSON
    await sandbox.remove_file("plain.txt")  # the valid names still work


def test_a_deep_tree_in_the_kernel_dir_does_not_stop_its_reset(tmp_path: Path) -> None:
    """Where the kernel runs as the service's uid (local, without root), the kernel directory
    is a plain one the code can fill; its next kernel's start empties it first."""
    kernel_dir = tmp_path / "kernel"
    kernel_dir.mkdir()
    plant_deep_tree(kernel_dir, "planted")
    os.symlink("/etc", kernel_dir / "link")
    reset_kernel_dir(kernel_dir)
    assert list(kernel_dir.iterdir()) == []
    assert Path("/etc/passwd").exists()


@pytest.mark.parametrize("where", ["workspace", "kernel"])
def test_a_session_directory_with_a_deep_tree_is_removed(tmp_path: Path, where: str) -> None:
    """Without root, nothing is a tmpfs to unmount: only removal can clear the directory."""
    dirs = SessionDirs(tmp_path / "sandbox-id")
    (dirs.root / where).mkdir(parents=True)
    plant_deep_tree(dirs.root / where, "deep")
    dirs.remove()
    assert not dirs.root.exists()
