"""The proxy's socket and its life: who may connect, what closing does, what every connection
leaves in the ledger."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.egress import EgressLedger, EgressProxy, EgressSettings
from tests.sandbox.egress.conftest import HELLO, StartProxy, UpstreamServer, curl, overrides
from tests.sandbox.egress.test_limits import open_tunnel


def allowed(upstream: UpstreamServer) -> dict[str, object]:
    return {
        "resolve_overrides": overrides("allowed.test"),
        "private_hosts": frozenset({f"allowed.test:{upstream.port}"}),
    }


async def test_a_peer_of_another_uid_is_refused_without_an_answer(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", peer_uid=os.getuid() + 4242, **allowed(upstream))
    code, _, _ = await curl("-x", running.url, f"http://allowed.test:{upstream.port}/")
    assert code != 0
    (record,) = await running.records(1)
    assert not record.allowed and "not of the sandbox's uid" in record.reason
    assert record.bytes_up == record.bytes_down == 0


async def test_the_peer_of_the_sandbox_uid_is_served(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", peer_uid=os.getuid(), **allowed(upstream))
    code, out, err = await curl("-x", running.url, f"http://allowed.test:{upstream.port}/")
    assert code == 0, err
    assert out.encode() == HELLO


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the socket a group needs root")
async def test_as_root_the_socket_is_for_root_and_the_sandbox_group_only(
    tmp_path: Path,
) -> None:
    proxy = EgressProxy(
        policy=NetworkPolicy(mode="any"),
        ceiling=NetworkPolicy(mode="any"),
        settings=EgressSettings(),
        ledger=EgressLedger("s"),
    )
    path = tmp_path / "proxy.sock"
    await proxy.start(path, peer_uid=54321, peer_gid=54321)
    try:
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert (info.st_uid, info.st_gid) == (0, 54321)
    finally:
        await proxy.close()


async def test_close_ends_open_tunnels_removes_the_socket_and_is_idempotent(
    start_proxy: StartProxy, upstream: UpstreamServer
) -> None:
    running = await start_proxy("any", **allowed(upstream))
    reader, writer = await open_tunnel(running.relay_port, f"allowed.test:{upstream.port}")
    await running.proxy.close()
    async with asyncio.timeout(30):
        assert await reader.read(-1) == b""
    writer.close()
    (record,) = await running.records(1)
    assert record.allowed and "egress proxy stopped" in record.reason
    assert not running.socket_path.exists()
    await running.proxy.close()
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(str(running.socket_path))


async def test_a_failing_record_hook_does_not_break_the_proxy(
    tmp_path: Path, upstream: UpstreamServer
) -> None:
    def broken(_: object) -> None:
        raise RuntimeError("metrics are down")

    ledger = EgressLedger("s", on_record=broken)
    proxy = EgressProxy(
        policy=NetworkPolicy(mode="any"),
        ceiling=NetworkPolicy(mode="any"),
        settings=EgressSettings(**allowed(upstream)),  # type: ignore[arg-type]
        ledger=ledger,
    )
    path = tmp_path / "p.sock"
    await proxy.start(path, peer_uid=None, peer_gid=None)
    try:
        for _ in range(2):
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(
                f"GET http://allowed.test:{upstream.port}/ HTTP/1.1\r\n"
                f"Host: allowed.test:{upstream.port}\r\n\r\n".encode()
            )
            async with asyncio.timeout(30):
                assert (await reader.read(-1)).endswith(HELLO)
            writer.close()
        assert ledger.totals.connections_allowed == 2
    finally:
        await proxy.close()


async def test_a_proxy_starts_once_and_refuses_a_too_long_socket_path(tmp_path: Path) -> None:
    proxy = EgressProxy(
        policy=NetworkPolicy(mode="any"),
        ceiling=NetworkPolicy(mode="any"),
        settings=EgressSettings(),
        ledger=EgressLedger("s"),
    )
    with pytest.raises(ValueError, match="longer than Unix sockets allow"):
        await proxy.start(tmp_path / ("x" * 120), peer_uid=None, peer_gid=None)
    await proxy.start(tmp_path / "ok.sock", peer_uid=None, peer_gid=None)
    with pytest.raises(RuntimeError):
        await proxy.start(tmp_path / "again.sock", peer_uid=None, peer_gid=None)
    await proxy.close()
