"""A saved state's size counts what describes its files (modes, times, links), against its
limit and its key's quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox import Backend
from sandbox.saved_report import StateTooLarge
from sandbox.saved_state import save_state
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(300)


async def test_a_saved_state_keeps_within_its_bytes_with_what_describes_its_files(
    backend: Backend, tmp_path: Path
) -> None:
    """The description of the files' modes, times and links is kept with the state: its bytes
    were left out of the state's size (so of the key's quota) and of its limit (up to 16 MB
    more for each snapshot or paused session)."""
    sandbox = await backend.create(small_spec())
    try:
        made = await sandbox.execute(
            "import os\nos.makedirs('many')\n"
            "for i in range(4000): open(f'many/{i:0200d}', 'w').close()"
        )
        assert made.ok, made.error
        # Room for it: the state's bytes are all it keeps (its report aside).
        saved = await save_state(sandbox, tmp_path / "state", max_bytes=5 << 20)
        on_disk = sum(p.stat().st_size for p in (tmp_path / "state").rglob("*") if p.is_file())
        on_disk -= (tmp_path / "state" / "state.json").stat().st_size
        assert saved.bytes == on_disk > 800_000, (saved.bytes, on_disk)
        # No room for it: refused, as files over the limit are.
        with pytest.raises(StateTooLarge):
            await save_state(sandbox, tmp_path / "small", max_bytes=600_000)
    finally:
        await sandbox.close()
