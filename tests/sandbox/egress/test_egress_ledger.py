"""The per-session egress ledger, the byte budget, the settings' normalization and the status
line of a refusal."""

from __future__ import annotations

import asyncio

import pytest

from sandbox.egress import EgressLedger, EgressRecord, EgressSettings
from sandbox.egress.metering import ByteBudget, Meter
from sandbox.egress.responses import answer, reason_phrase

pytestmark = pytest.mark.unit


def _record(allowed: bool) -> EgressRecord:
    return EgressRecord(0.0, "h.test", 443, "CONNECT", allowed, "r", None, 1, 2, 0.1)


def test_the_ledger_keeps_the_latest_records_and_counts_all() -> None:
    seen: list[EgressRecord] = []
    ledger = EgressLedger("s", keep=3, on_record=seen.append)
    for i in range(10):
        ledger.add(_record(allowed=i % 2 == 0))
    assert len(ledger.records) == 3 and len(seen) == 10
    assert (ledger.totals.connections_allowed, ledger.totals.connections_refused) == (5, 5)


def test_a_failing_hook_is_contained() -> None:
    def broken(_: EgressRecord) -> None:
        raise RuntimeError("down")

    ledger = EgressLedger("s", on_record=broken)
    ledger.add(_record(allowed=True))
    assert ledger.totals.connections_allowed == 1


async def test_the_budget_cuts_exactly_at_the_cap() -> None:
    ledger = EgressLedger("s")
    meter = Meter(ByteBudget(ledger, cap=10))
    assert meter.take(b"abcdef", up=True) == b"abcdef"
    assert meter.take(b"ghijkl", up=False) == b"ghij"
    assert meter.take(b"x", up=True) == b""
    assert ledger.bytes_used == 10 and (meter.up, meter.down) == (6, 4)
    assert meter.budget.exhausted
    await asyncio.sleep(0)


def test_settings_normalize_names() -> None:
    settings = EgressSettings(
        private_hosts=frozenset({"Index.Local."}), resolve_overrides={"A.Test": ("127.0.0.1",)}
    )
    assert dict(settings.private_ports) == {"index.local": {80, 443}}
    assert dict(settings.resolve_overrides) == {"a.test": ("127.0.0.1",)}
    with pytest.raises(ValueError):
        EgressSettings(max_connections_per_session=0)


def test_the_reason_phrase_is_printable_ascii_and_capped() -> None:
    phrase = reason_phrase("bücher\r\nX-Injected: 1 " + "y" * 500)
    assert phrase.isascii() and "\r" not in phrase and "\n" not in phrase
    assert len(phrase) == 200 and phrase.endswith("...")
    head = answer(403, "x\r\nSet-Cookie: a=b", "body").split(b"\r\n\r\n")[0]
    assert b"\r\nSet-Cookie" not in head
