"""The ports a local Ray node is started with: distinct, free, never the head's.

Ray refuses a node two of whose components were given one port; ports picked one at a time
can repeat, since the kernel may hand a port just closed out again (the CI failure this guards
against: `object_manager` and `metrics_export` both given 51447)."""

from __future__ import annotations

import socket

from sandbox.backends.ray_cluster.local_cluster import free_ports
from sandbox.backends.ray_cluster.loopback import LOOPBACK


def test_ports_picked_together_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(ports) == 64
    assert len(set(ports)) == 64
    held = []
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind((LOOPBACK, port))  # each is free once the picking has let them go
    finally:
        for s in held:
            s.close()


def test_ports_set_aside_are_never_picked() -> None:
    # The ports just let go are the likeliest to be handed out again.
    aside = free_ports(32)
    for _ in range(8):
        assert not set(free_ports(32, besides=aside)) & set(aside)
