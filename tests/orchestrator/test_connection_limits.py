"""The connection caps' arithmetic: how much of the open-file limit the HTTP connections may take,
and which client a connection counts against (tests/security/test_slow_connections.py runs the
caps against a real server)."""

from __future__ import annotations

import resource
import socket
import subprocess
from pathlib import Path

import pytest

from orchestrator.connection_guard import address_key
from orchestrator.http_server import (
    KERNEL_BACKLOG,
    accept_batch,
    address_cap,
    connection_cap,
    listening_socket,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("open_files", "cap"),
    [
        (1024, 512),  # a systemd default that could not be raised: half stays for the service
        (2048, 1024),
        (20_000, 4096),  # the setting, well below the limit less a quarter
        (1 << 20, 4096),
        (resource.RLIM_INFINITY, 4096),
    ],
)
def test_the_cap_leaves_descriptors_for_the_services_own_work(open_files: int, cap: int) -> None:
    assert connection_cap(4096, open_files) == cap


def test_a_tiny_limit_still_serves_someone() -> None:
    assert connection_cap(4096, 1) == 1


@pytest.mark.parametrize(
    ("open_files", "batch"),
    [(1024, 64), (2048, 128), (20_000, 256), (resource.RLIM_INFINITY, 256), (100, 16)],
)
def test_four_bursts_of_accepts_fit_in_half_of_what_the_cap_leaves(
    open_files: int, batch: int
) -> None:
    """asyncio accepts a batch at each wake-up and holds up to four before the guard's
    refusals free their descriptors: with 1,024 files, batches of 256 ran the service out of
    descriptors (EMFILE) under a burst of 3,000 connects."""
    assert accept_batch(open_files, connection_cap(4096, open_files)) == batch


@pytest.mark.parametrize(
    ("wanted", "total_wanted", "total", "cap"),
    [
        (512, 4096, 4096, 512),
        (4096, 4096, 4096, 4096),  # behind a proxy, as the operator chose
        (512, 4096, 512, 256),  # the total lowered (1,024 files): one address at most half
        (9, 4096, 1, 1),
    ],
)
def test_one_address_may_hold_at_most_half_of_a_lowered_total(
    wanted: int, total_wanted: int, total: int, cap: int
) -> None:
    assert address_cap(wanted, total_wanted, total) == cap


def test_the_listening_port_is_held_from_the_start_and_queues_long() -> None:
    """The service binds its port itself (port 0: any free one) before the app is made, so
    the port the sandboxes' proxies refuse is the one served, and nothing can take it in
    between (a port probed free and bound later could be)."""
    sock = listening_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port != 0
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        sock.listen(64)  # what asyncio asks for (its batch of accepts)...
        listed = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert int(listed[2]) == min(KERNEL_BACKLOG, somaxconn)  # ...the kernel's queue: long
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("203.0.113.9", "203.0.113.9"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", "2001:db8:1:2::/64"),  # one host's /64 is one client
        ("::ffff:203.0.113.9", "203.0.113.9"),
        ("fe80::1%eth0", "fe80::/64"),
        ("", ""),  # a Unix socket's peer
    ],
)
def test_a_connection_counts_against_its_client(host: str, key: str) -> None:
    assert address_key(host) == key
