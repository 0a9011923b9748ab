"""A sandbox's state saved while its code keeps making and removing files is saved whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox import Backend
from sandbox.saved_state import save_state
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(300)

# A thread of the kernel's that keeps making and removing files while the state is saved.
_CHURN = """
import os, threading
os.makedirs('stable', exist_ok=True)
for i in range(400):
    open(f'stable/{i}', 'w').write('x' * 1000)
kept = 11
def churn():
    os.makedirs('churn', exist_ok=True)
    while True:
        for i in range(50):
            open(f'churn/{i}', 'w').write('y')
        for i in range(50):
            os.remove(f'churn/{i}')
threading.Thread(target=churn, daemon=True).start()
"""


async def test_files_that_come_and_go_while_the_state_is_saved_do_not_fail_it(
    backend: Backend, tmp_path: Path
) -> None:
    """An idle session whose code still writes temporary files (a thread, a process beside the
    kernel): a file listed, then removed before it is copied, failed the whole save, so the
    idle expiry ended the session (all lost) instead of pausing it."""
    sandbox = await backend.create(small_spec())
    try:
        started = await sandbox.execute(_CHURN)
        assert started.ok, started.error
        for attempt in range(3):
            saved = await save_state(sandbox, tmp_path / f"state{attempt}", max_bytes=50 << 20)
            assert saved.files >= 400 and "kept" in saved.saved
    finally:
        await sandbox.close()
