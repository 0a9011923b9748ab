"""A sandbox's variables and files, saved and brought back into a new sandbox (both backends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from code_interpreter_wire.errors import StateNotSaved
from sandbox import Backend
from sandbox.saved_state import restore_state, save_state
from tests.conftest import small_spec
from tests.orchestrator.persistence.state_code import BUILD, CHECK, CHECKED


async def test_variables_and_files_come_back_in_a_new_sandbox(
    backend: Backend, tmp_path: Path
) -> None:
    first = await backend.create(small_spec(default_timeout_s=120.0))
    try:
        built = await first.execute(BUILD)
        assert built.ok, built.error
        saved = await save_state(first, tmp_path / "state", max_bytes=200 << 20)
    finally:
        await first.close()
    assert "gen" in saved.unsaved and "generator" in saved.unsaved["gen"]
    assert {"df", "model", "triple", "Point", "p", "same"} <= set(saved.saved)
    assert saved.files == 1 and saved.namespace_bytes > 8_000_000
    second = await backend.create(small_spec(default_timeout_s=120.0))
    try:
        restored = await restore_state(second, tmp_path / "state")
        assert "gen (" in restored.notice and restored.files == 1, restored.notice
        checked = await second.execute(CHECK)
        assert checked.ok, checked.error
        assert checked.stdout.split() == CHECKED
        names = [f.path for f in await second.list_files("", recursive=True)]
        assert not [n for n in names if n.startswith(".cir-state")], names
    finally:
        await second.close()


async def test_a_forged_report_is_refused_and_the_sandbox_runs_on(
    backend: Backend, tmp_path: Path
) -> None:
    """Sandboxed code may rewrite what the kernel reports of its state: the host checks it."""
    sandbox = await backend.create(small_spec())
    try:
        # The kernel reports `sys.version`'s first word: 500 characters are no Python version.
        forged = await sandbox.execute("import sys; sys.version = 'x' * 500; kept = 1")
        assert forged.ok, forged.error
        with pytest.raises(StateNotSaved, match="not understood"):
            await save_state(sandbox, tmp_path / "state", max_bytes=10 << 20)
        after = await sandbox.execute("print(kept)")
        assert after.stdout.strip() == "1"
        assert not [f for f in await sandbox.list_files("") if f.path.startswith(".cir")]
    finally:
        await sandbox.close()


async def test_modes_links_times_and_empty_directories_come_back(
    backend: Backend, tmp_path: Path
) -> None:
    make = (
        "import os\n"
        "open('run.sh', 'w').write('#!/bin/sh\\necho hi\\n'); os.chmod('run.sh', 0o755)\n"
        "os.makedirs('empty/inner'); os.symlink('run.sh', 'link'); os.symlink('/etc', 'out')\n"
        "os.utime('run.sh', (1_000_000_000, 1_000_000_000))\n"
    )
    first = await backend.create(small_spec())
    try:
        assert (await first.execute(make)).ok
        await save_state(first, tmp_path / "state", max_bytes=10 << 20)
    finally:
        await first.close()
    second = await backend.create(small_spec())
    try:
        await restore_state(second, tmp_path / "state")
        check = (
            "import os\n"
            "print(oct(os.stat('run.sh').st_mode & 0o777), os.readlink('link'),"
            " os.readlink('out'), os.path.isdir('empty/inner'),"
            " int(os.stat('run.sh').st_mtime), os.path.exists('.cir-state'))"
        )
        checked = await second.execute(check)
        assert checked.stdout.split() == [
            "0o755",
            "run.sh",
            "/etc",
            "True",
            "1000000000",
            "False",
        ], checked
    finally:
        await second.close()
