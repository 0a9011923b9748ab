"""The audit queue is bounded in memory, not only in events: while the store cannot keep up,
events holding long code fill at most a byte budget; past it they are dropped and counted, as
past the count."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.governance import audit_kinds
from orchestrator.governance.audit import MAX_QUEUED_CHARS, AuditLog
from orchestrator.settings_sections import AuditSection

pytestmark = pytest.mark.unit


def test_long_events_queue_within_the_byte_budget(tmp_path: Path) -> None:
    settings = Settings(auth_disabled=True, state_dir=tmp_path, audit_queue_max=1_000_000)
    log = AuditLog(
        AuditSection.of(settings), name_of=lambda owner: owner
    )  # not started: nothing is written
    code = "x" * settings.audit_max_code_chars
    fits = MAX_QUEUED_CHARS // len(code)
    for _ in range(fits + 50):
        log.record(audit_kinds.EXECUTION, owner="p_1", details={"code": code})
    assert log.queued_chars <= MAX_QUEUED_CHARS
    assert fits - 5 <= log.pending <= fits
    assert log.dropped >= 50
    queued = log.pending
    log.record(audit_kinds.SESSION_CREATED, owner="p_1")  # a small one still fits
    assert log.pending == queued + 1
