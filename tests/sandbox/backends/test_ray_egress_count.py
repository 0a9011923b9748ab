"""The cluster's count of egress connections (egress_counter.py), as its actor runs it: a key's
cap and the service's, each refusal naming its cap; a holder's heartbeat setting its count
anew; a holder gone silent (its node lost) freed after its lease. The clock is the test's, so
a lease runs out when the test says. Through Ray, across nodes: tests/cluster/test_ray_egress.py.
"""

from __future__ import annotations

import pytest

from sandbox.backends.ray_cluster.egress_counter import EgressCount
from sandbox.egress.slots import SharedCaps

ALICE = SharedCaps("alice", per_key=2, total=3)
BOB = SharedCaps("bob", per_key=2, total=3)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_keys_cap_then_the_services_each_named() -> None:
    count = EgressCount(lease_s=30, clock=Clock())
    assert count.take("s1", ALICE) is None
    assert count.take("s2", ALICE) is None  # another session of the key, on another node
    refused = count.take("s1", ALICE)
    assert refused is not None and refused.reason == "too many connections"
    assert "egress_max_connections_per_key" in refused.text and "2 connections" in refused.text
    assert count.take("s3", BOB) is None
    refused = count.take("s3", BOB)
    assert refused is not None and "egress_max_connections_total" in refused.text
    assert count.counts() == (3, {"alice": 2, "bob": 1})
    count.give_back("s2")
    assert count.take("s3", BOB) is None  # a slot given back is free for any key
    assert count.counts() == (3, {"alice": 1, "bob": 2})


def test_a_refusal_holds_nothing_and_a_dropped_holder_frees_all_it_held() -> None:
    count = EgressCount(lease_s=30, clock=Clock())
    for _ in range(2):
        assert count.take("s1", ALICE) is None
    assert count.take("s1", ALICE) is not None
    assert count.counts() == (2, {"alice": 2})
    count.drop("s1")
    assert count.counts() == (0, {})
    count.give_back("s1")  # late, after the drop: nothing below zero
    assert count.counts() == (0, {})


def test_a_heartbeat_sets_the_count_anew_as_after_a_restart() -> None:
    count = EgressCount(lease_s=30, clock=Clock())  # a restarted count starts empty
    count.hold("s1", "alice", 2)
    count.hold("s3", "bob", 1)
    assert count.counts() == (3, {"alice": 2, "bob": 1})
    refused = count.take("s3", BOB)
    assert refused is not None and "egress_max_connections_total" in refused.text
    count.hold("s1", "alice", 1)  # one of its connections ended while the count was away
    assert count.counts() == (2, {"alice": 1, "bob": 1})


def test_a_holder_not_heard_from_for_its_lease_is_freed_and_a_live_one_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    count = EgressCount(lease_s=30, clock=clock)
    assert count.heartbeat_s() == 10
    assert count.take("lost", ALICE) is None  # its node dies with this connection
    assert count.take("live", BOB) is None
    clock.now += 30  # within the lease: still counted
    count.hold("live", "bob", 1)
    assert count.counts() == (2, {"alice": 1, "bob": 1})
    for _ in range(2):  # 20 s more, the live one beating every 10 s
        clock.now += 10
        count.hold("live", "bob", 1)
    assert count.counts() == (1, {"bob": 1})
    assert "not heard from for 30 s" in caplog.text and "its 1 connections freed" in caplog.text


def test_a_holder_holding_none_is_forgotten_and_never_said_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    count = EgressCount(lease_s=30, clock=clock)
    assert count.take("idle", ALICE) is None
    count.give_back("idle")
    count.hold("quiet", "bob", 0)
    clock.now += 120
    assert count.counts() == (0, {})
    assert "not heard from" not in caplog.text


def test_a_restarted_count_is_told_apart() -> None:
    assert EgressCount().incarnation() != EgressCount().incarnation()


@pytest.mark.parametrize("lease_s", [0, -1])
def test_a_lease_must_be_positive(lease_s: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        EgressCount(lease_s=lease_s)


def test_caps_must_be_positive_and_name_their_key() -> None:
    with pytest.raises(ValueError, match="positive"):
        SharedCaps("alice", per_key=0, total=3)
    with pytest.raises(ValueError, match="owner"):
        SharedCaps("", per_key=1, total=3)
