"""Walking and removing trees the sandbox controls: any depth, one open per directory, no
symlink followed, nothing outside the tree touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.dir_stack import DirStack
from sandbox.tree_removal import remove_tree, remove_tree_at
from sandbox.workspace_files import Workspace
from tests.security.test_file_abuse import plant_deep_tree

pytestmark = pytest.mark.unit


def test_removal_goes_past_path_max_and_never_follows_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    tree = tmp_path / "tree"
    tree.mkdir()
    plant_deep_tree(tree, "deep", depth=2500)  # 5,000 bytes of path: past PATH_MAX
    os.symlink(outside, tree / "dir-link")
    os.symlink(outside / "keep.txt", tree / "file-link")
    locked = tree / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0o000)
    remove_tree_at(tree)
    assert not tree.exists()
    assert (outside / "keep.txt").read_text() == "keep"


def test_removal_of_a_file_or_a_missing_name(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        remove_tree(fd, "f")
        with pytest.raises(FileNotFoundError):
            remove_tree(fd, "f")
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []


def test_a_deep_walk_opens_each_directory_once_and_keeps_few_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant_deep_tree(tmp_path, "deep", depth=2000)
    opens = 0
    real_open = os.open

    def counting_open(*args: object, **kwargs: object) -> int:
        nonlocal opens
        opens += 1
        return real_open(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting_open)
    before = len(os.listdir("/proc/self/fd"))
    entries = Workspace(str(tmp_path)).list_dir("", recursive=True)
    assert len(entries) == 1 + 2000 + 2001
    assert opens < 3 * 2001, f"{opens} opens for 2,001 directories"  # once down, once back up
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_dir_stack_going_up_checks_it_returns_where_it_was(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    stack = DirStack(top, window=2)
    try:
        for name in ("a", "b", "c"):
            stack.push(name)
        os.rename(tmp_path / "a" / "b", tmp_path / "elsewhere" / "b")  # moved under the walk
        stack.pop()  # back to b: still open
        with pytest.raises(OSError, match="moved"):
            stack.pop()  # back to a: closed, and b's parent is no longer a
    finally:
        stack.close()
        os.close(top)


def test_listing_depth_is_limited(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    paths = [e.path for e in Workspace(str(tmp_path)).list_dir(recursive=True, max_depth=1)]
    assert paths == ["a", "a/b"]
