"""The host uid pool: distinct uids per live sandbox, in this process and across processes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.uids import HostUidPool


@pytest.fixture
def claims() -> Iterator[Path]:
    """Where the pool claims its uids: a directory of the test's own."""
    root = Path(tempfile.mkdtemp(prefix="cir-uids-"))
    try:
        yield root / "claims"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_uids_are_distinct_until_released(claims: Path) -> None:
    pool = HostUidPool(2_000_000, 3, claims_dir=claims)
    held = {pool.allocate() for _ in range(3)}
    assert held == {2_000_000, 2_000_001, 2_000_002} == pool.in_use
    with pytest.raises(BackendUnavailable, match="all 3 sandbox uids from 2000000 are in use"):
        pool.allocate()
    pool.release(2_000_001)
    pool.release(2_000_001)  # twice is harmless
    assert pool.allocate() == 2_000_001


HOLDER = """
import sys
from pathlib import Path
from sandbox.uids import HostUidPool
pool = HostUidPool(2_000_000, 2, claims_dir=Path(sys.argv[1]))
print(pool.allocate(), flush=True)
sys.stdin.read()  # hold it until told to go
"""


def test_another_process_holding_a_uid_is_skipped_until_it_exits(claims: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(claims)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        theirs = int(holder.stdout.readline())
        pool = HostUidPool(2_000_000, 2, claims_dir=claims)
        mine = pool.allocate()
        assert mine != theirs
        with pytest.raises(BackendUnavailable):
            pool.allocate()
    finally:
        holder.kill()
        holder.wait()
    assert pool.allocate() == theirs  # its lock died with it


def test_a_claims_dir_others_can_write_is_refused(claims: Path) -> None:
    claims.mkdir()
    claims.chmod(0o777)
    with pytest.raises(BackendUnavailable, match="not a private directory"):
        HostUidPool(2_000_000, 2, claims_dir=claims).allocate()
