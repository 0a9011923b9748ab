"""Which sandbox directories a clean-up removes: never one another process is making now."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from sandbox.state_dir import SessionDirs

pytestmark = pytest.mark.unit


def test_a_directory_being_made_is_not_an_orphan_but_an_old_ownerless_one_is(
    tmp_path: Path,
) -> None:
    base = tmp_path / "local"
    base.mkdir()
    making = base / "aaaa"  # made a moment ago; its owner file is not written yet
    making.mkdir()
    old = base / "bbbb"  # ownerless for long: a crash between mkdir and the owner file
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    dead = base / "cccc"  # its owner is a process that is gone
    dead.mkdir()
    (dead / "owner").write_text(json.dumps({"pid": 2**22 + 7, "start": 1}))
    removed = SessionDirs.remove_orphans(tmp_path, "local")
    assert sorted(removed) == ["bbbb", "cccc"]
    assert making.is_dir()
