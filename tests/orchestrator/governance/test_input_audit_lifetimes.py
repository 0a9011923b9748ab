"""Input typed into processes, in the audit log, across the ends of what holds it: nothing
gathered is lost when the service stops (or a session is paused), a session's end frees its
rate's window, and `code-interpreter audit list` prints typed text inert (escape sequences a
terminal would obey are shown as `\\xNN`). A real AuditLog on a real SQLite state dir."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from orchestrator.config import Settings
from orchestrator.governance import audit_kinds
from orchestrator.governance.audit import AuditLog
from orchestrator.governance.input_audit import FLUSH_S, InputAudit
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from orchestrator.settings_sections import AuditSection
from tests.orchestrator.governance.store_handles import StoreHandle, local_store


@pytest.fixture
async def logged(tmp_path: Path) -> AsyncIterator[tuple[AuditLog, StoreHandle]]:
    store = local_store(tmp_path / "state")
    audit = AuditLog(
        AuditSection.of(Settings(auth_disabled=True, state_dir=tmp_path / "state")), lambda o: o
    )
    audit.start(store.audit)
    yield audit, store
    await audit.close()
    await store.close()


async def inputs(audit: AuditLog, store: StoreHandle, count: int) -> list[AuditEvent]:
    """The `process.input` events, oldest first, once `count` are written (and no more wait)."""
    query = AuditQuery(kinds=[audit_kinds.PROCESS_INPUT], limit=100)
    deadline = time.monotonic() + 10
    while True:
        found = list(reversed((await store.audit.query_page(query)).events))
        if len(found) >= count and not audit.pending:
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.01)


async def test_what_is_gathered_or_dropped_is_written_when_the_service_closes(
    logged: tuple[AuditLog, StoreHandle],
) -> None:
    audit, store = logged
    typed = InputAudit(audit, record_bytes=64, records_per_minute=1)
    typed.typed("s-1", "p_a", 7, b"rm -rf /tmp/x\n", terminal=True)  # the rate's one record
    typed.typed("s-1", "p_a", 7, b"over the rate\n", terminal=True)  # dropped, counted
    assert len(await inputs(audit, store, 1)) == 1
    started = time.monotonic()
    typed.typed("s-2", "p_a", 9, b"no newline yet", terminal=False)  # gathered
    typed.close()
    found = await inputs(audit, store, 3)
    assert time.monotonic() - started < FLUSH_S  # at once, not when a timer would have
    assert sorted((e.session_id, e.status or "", e.details.get("text")) for e in found) == [
        ("s-1", "", "rm -rf /tmp/x\n"),
        ("s-1", "dropped", None),
        ("s-2", "", "no newline yet"),
    ], found
    [told] = [e for e in found if e.status == "dropped"]
    assert told.details["dropped_bytes"] == len(b"over the rate\n")
    typed.close()  # twice: nothing more
    assert len(await inputs(audit, store, 3)) == 3


async def test_a_paused_session_writes_its_input_and_keeps_its_rate(
    logged: tuple[AuditLog, StoreHandle],
) -> None:
    """Pausing writes what is gathered (its processes are gone) but keeps the rate's window:
    a pause and a resume are no way around the rate."""
    audit, store = logged
    typed = InputAudit(audit, record_bytes=64, records_per_minute=1)
    typed.typed("s-1", "p_a", 7, b"half a line", terminal=True)
    typed.flush_session("s-1")
    typed.typed("s-1", "p_a", 8, b"after the resume\n", terminal=True)
    typed.close()
    found = await inputs(audit, store, 2)
    assert [(e.status, e.details.get("text")) for e in found] == [
        (None, "half a line"),
        ("dropped", None),
    ], found


async def test_the_end_of_a_session_frees_its_rate_window(
    logged: tuple[AuditLog, StoreHandle],
) -> None:
    audit, store = logged
    typed = InputAudit(audit, record_bytes=64, records_per_minute=1)
    typed.typed("s-1", "p_a", 7, b"one\n", terminal=False)
    typed.forget_session("s-1")
    # Its window is gone with it (a session id is never used again; this shows it was freed).
    typed.typed("s-1", "p_a", 7, b"two\n", terminal=False)
    found = await inputs(audit, store, 2)
    assert [(e.status, e.details.get("text")) for e in found] == [(None, "one\n"), (None, "two\n")]


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x9b31m\x7f\x00"


async def test_audit_list_shows_typed_escape_sequences_inert(
    logged: tuple[AuditLog, StoreHandle], tmp_path: Path
) -> None:
    audit, store = logged
    typed = InputAudit(audit, record_bytes=1024, records_per_minute=10)
    typed.typed("s-1", "p_a", 7, ESCAPES.encode() + b"\n", terminal=True)
    assert len(await inputs(audit, store, 1)) == 1
    result = await asyncio.to_thread(  # the CLI runs an event loop of its own
        CliRunner().invoke,
        cli_app,
        ["audit", "list", "--state-dir", str(tmp_path / "state"), "--kind", "process.input"],
    )
    assert result.exit_code == 0, result.output
    [line] = result.stdout.splitlines()
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in line), repr(line)
    assert "text=\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\x7f\\x00 bytes=" in line, line
