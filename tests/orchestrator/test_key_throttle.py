"""The throttle of wrong keys on its own: budgets per address and per key prefix, who is never
held back, the log line, and memory that stays bounded under a flood of distinct addresses."""

from __future__ import annotations

import logging

import pytest

from orchestrator.key_throttle import (
    PREFIX_CHARS,
    KeyThrottle,
    TooManyWrongKeys,
    address_of,
)

pytestmark = pytest.mark.unit

RIGHT_KEY = "cir_RightKeyOfTheOwner"


def guess(throttle: KeyThrottle, client: str, key: str) -> bool:
    """One wrong key from `client`: whether it was checked (not refused unchecked)."""
    try:
        throttle.before_check(client, key)
    except TooManyWrongKeys:
        return False
    throttle.failed(client, key)
    return True


def test_an_address_over_its_budget_is_refused_with_a_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle = KeyThrottle(per_address=5, per_prefix=1000, max_tracked=100)
    with caplog.at_level(logging.WARNING, logger="orchestrator.key_throttle"):
        checked = [guess(throttle, "10.0.0.1", f"wrong-{i}") for i in range(8)]
    assert checked == [True] * 5 + [False] * 3
    with pytest.raises(TooManyWrongKeys, match="at most 5 a minute") as caught:
        throttle.before_check("10.0.0.1", RIGHT_KEY)  # even a right key: unchecked
    assert 1 <= caught.value.retry_after_s <= 61  # a minute, and a second of margin
    # One line when it went over, not one per refusal.
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("key guessing: 10.0.0.1 sent 5 wrong keys within a minute")
    throttle.before_check("10.0.0.2", RIGHT_KEY)  # another address: checked at once


def test_a_prefix_over_its_budget_refuses_only_addresses_that_failed() -> None:
    throttle = KeyThrottle(per_address=100, per_prefix=10, max_tracked=100)
    near = RIGHT_KEY[:PREFIX_CHARS] + "guess"
    # A guesser spread over many addresses, one wrong key each, all like the owner's key.
    for i in range(10):
        assert guess(throttle, f"10.0.1.{i}", f"{near}{i}")
    assert not guess(throttle, "10.0.1.0", f"{near}again")  # it failed lately: refused
    assert guess(throttle, "10.0.1.0", "another-prefix")  # another prefix: checked
    assert guess(throttle, "10.0.2.1", f"{near}x")  # a clean address's first key: checked
    throttle.before_check("10.0.3.1", RIGHT_KEY)  # the owner, sending no wrong key: checked


def test_ipv6_clients_are_counted_by_their_64() -> None:
    assert (
        address_of("2001:db8:1:2::1") == address_of("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    )
    assert address_of("2001:db8:1:3::1") != address_of("2001:db8:1:2::1")
    assert address_of("::ffff:10.1.2.3") == "10.1.2.3"
    assert address_of(None) == address_of("") == "unknown"
    throttle = KeyThrottle(per_address=3, per_prefix=1000, max_tracked=100)
    for i in range(3):
        assert guess(throttle, f"2001:db8:1:2::{i + 1}", f"wrong-{i}")
    assert not guess(throttle, "2001:db8:1:2::99", "wrong-x")


def test_memory_stays_bounded_under_a_flood_of_addresses() -> None:
    cap = 200
    throttle = KeyThrottle(per_address=5, per_prefix=5, max_tracked=cap)
    for i in range(20_000):  # distinct addresses and prefixes, a wrong key each
        guess(throttle, f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", f"{i:08d}-wrong")
    assert throttle.tracked() == (cap, cap)
    storage = throttle.storage
    # Two counters (this window's and the last's) at most per counted name, of two kinds.
    assert len(storage.storage) <= 4 * cap + 8
    assert len(storage.expirations) <= 4 * cap + 8
    assert len(storage.locks) <= 4 * cap + 8
    # The most recent are the ones still counted.
    last = 19_999
    recent = f"10.{last >> 16 & 255}.{last >> 8 & 255}.{last & 255}"
    for _ in range(4):
        assert guess(throttle, recent, "wrong")
    assert not guess(throttle, recent, "wrong")
