"""The guards on credential substitution, through the proxy on loopback (the servers of
test_credential_proxy.py): a value only in the headers its binding names, a capped number of
swaps and a head size the values may not push over the limit (431), never in a TRACE, path
prefixes by whole segments, outcomes noted once per connection (no log line per request), and a
client that starts its TLS before the proxy's 200 answered 400 at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from sandbox.egress.credentials import (
    HEAD_TOO_LARGE,
    HEADER_NOT_BOUND,
    MAX_OUTCOMES,
    MAX_SWAPS_PER_NAME,
    METHOD_NOT_BOUND,
    PATH_NOT_BOUND,
    SUBSTITUTED,
    TOO_MANY_PLACEHOLDERS,
    UNKNOWN_NAME,
    CredentialBinding,
    CredentialBindings,
)
from sandbox.egress.interception import TlsInterceptor, generate_ca
from tests.sandbox.egress.conftest import Running, StartProxy
from tests.sandbox.egress.test_credential_proxy import (
    Reply,
    Servers,
    _issue,
    _request,
    https_via_proxy,
    servers,  # noqa: F401  (the module's fixture)
)

VALUE = "sk-real-guarded-91d2"
CUSTOM_VALUE = "custom-real-5e5e"
BIG_VALUE = "b" * 5000
MAX_HEAD = 16 * 1024
HOSTS = ("api.test", "other.test", "gh.test")


@pytest.fixture
async def guarded(start_proxy: StartProxy, servers: Servers) -> Running:  # noqa: F811
    for seen in servers.seen.values():
        seen.clear()
    secrets = CredentialBindings(
        [
            CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test",)),
            CredentialBinding("BIG_KEY", BIG_VALUE, hosts=("api.test",)),
            CredentialBinding("CUSTOM", CUSTOM_VALUE, hosts=("other.test",), headers=["X-Custom"]),
            CredentialBinding("PATHED", VALUE, hosts=("gh.test",), path_prefixes=("/v1",)),
        ]
    )
    return await start_proxy(
        {"allow": [{"host": name, "ports": [servers.api_tls]} for name in HOSTS]},
        resolve_overrides={name: ("127.0.0.1",) for name in HOSTS},
        private_hosts=frozenset(f"{name}:{servers.api_tls}" for name in HOSTS),
        upstream_ca_file=servers.upstream_ca_file,
        max_head_bytes=MAX_HEAD,
        credentials=secrets,
        interceptor=TlsInterceptor(servers.deployment.cert_pem, servers.deployment.key_pem),
    )


async def _send(
    running: Running,
    servers: Servers,  # noqa: F811
    host: str,
    headers: dict[str, str],
    method: str = "GET",
    path: str = "/v1/x",
) -> Reply:
    request = _request(method, path, f"{host}:{servers.api_tls}", headers)
    return await https_via_proxy(
        running, host, servers.api_tls, servers.deployment_ca_file, request
    )


def _no_value_anywhere(running: Running, caplog: pytest.LogCaptureFixture) -> None:
    for record in running.ledger.records:
        text = repr(record) + record.describe("s-test")
        assert VALUE not in text and CUSTOM_VALUE not in text and BIG_VALUE not in text
    for value in (VALUE, CUSTOM_VALUE, BIG_VALUE):
        assert value not in caplog.text


async def test_a_value_goes_only_in_the_headers_its_binding_names(
    guarded: Running,
    servers: Servers,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An API echoing Idempotency-Key or X-Request-Id would hand the value back: those keep
    the placeholder; Authorization (a default) gets it. A binding naming X-Custom gets it there
    only, not in Authorization."""
    caplog.set_level(logging.DEBUG)
    placeholder = "cir-secret://OPENAI_KEY"
    reply = await _send(
        guarded,
        servers,
        "api.test",
        {
            "Authorization": f"Bearer {placeholder}",
            "Idempotency-Key": placeholder,
            "X-Request-Id": placeholder,
        },
    )
    assert reply.status == 200, reply.head
    (seen,) = servers.seen["api"]
    assert seen["headers"]["authorization"] == f"Bearer {VALUE}"
    assert seen["headers"]["idempotency-key"] == seen["headers"]["x-request-id"] == placeholder
    assert VALUE.encode() not in reply.body.replace(f"Bearer {VALUE}".encode(), b"")
    (record,) = await guarded.records(1)
    assert record.credentials == (("OPENAI_KEY", SUBSTITUTED), ("OPENAI_KEY", HEADER_NOT_BOUND))
    assert "OPENAI_KEY: sent unchanged: header not bound" in record.describe("s-test")

    custom = "cir-secret://CUSTOM"
    reply = await _send(
        guarded, servers, "other.test", {"X-Custom": custom, "Authorization": custom}
    )
    assert reply.status == 200, reply.head
    seen = servers.seen["api"][1]
    assert seen["headers"]["x-custom"] == CUSTOM_VALUE
    assert seen["headers"]["authorization"] == custom
    _no_value_anywhere(guarded, caplog)


async def test_swaps_are_capped_and_a_head_too_large_with_its_values_is_refused_431(
    guarded: Running,
    servers: Servers,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    many = ",".join(["cir-secret://OPENAI_KEY"] * 10)
    reply = await _send(guarded, servers, "api.test", {"Authorization": many})
    assert reply.status == 200, reply.head
    received = servers.seen["api"][0]["headers"]["authorization"].split(",")
    assert received == [VALUE] * MAX_SWAPS_PER_NAME + ["cir-secret://OPENAI_KEY"] * 6
    (record,) = await guarded.records(1)
    assert record.credentials == (
        ("OPENAI_KEY", SUBSTITUTED),
        ("OPENAI_KEY", TOO_MANY_PLACEHOLDERS),
    )

    # 4 x 5000 bytes of value: over the 16 KiB head limit, though the request is small.
    big = ",".join(["cir-secret://BIG_KEY"] * 4)
    reply = await _send(guarded, servers, "api.test", {"Authorization": big})
    assert reply.status == 431, reply.head
    assert b"over the proxy's limit of 16384" in reply.head + reply.body
    assert BIG_VALUE[:100].encode() not in reply.head + reply.body
    assert len(servers.seen["api"]) == 1  # nothing sent
    _, refused = await guarded.records(2)
    assert not refused.allowed and refused.credentials == (("BIG_KEY", HEAD_TOO_LARGE),)
    _no_value_anywhere(guarded, caplog)


async def test_trace_never_gets_a_value(
    guarded: Running,
    servers: Servers,  # noqa: F811
) -> None:
    """TRACE echoes the request back: the placeholder goes as it is."""
    reply = await _send(
        guarded, servers, "api.test", {"Authorization": "cir-secret://OPENAI_KEY"}, "TRACE"
    )
    assert reply.status == 200, reply.head
    assert servers.seen["api"][0]["headers"]["authorization"] == "cir-secret://OPENAI_KEY"
    assert VALUE.encode() not in reply.body
    (record,) = await guarded.records(1)
    assert record.credentials == (("OPENAI_KEY", METHOD_NOT_BOUND),)


@pytest.mark.parametrize(
    ("path", "outcome"),
    [
        ("/v1/models", SUBSTITUTED),
        ("/v1", SUBSTITUTED),
        ("/v1-admin", PATH_NOT_BOUND),
        ("/v1/..;/admin", PATH_NOT_BOUND),
        ("/v1//admin", PATH_NOT_BOUND),
        ("/v1/%252e%252e/admin", PATH_NOT_BOUND),
    ],
)
async def test_a_path_prefix_covers_whole_segments_only(
    guarded: Running,
    servers: Servers,  # noqa: F811
    path: str,
    outcome: str,
) -> None:
    reply = await _send(
        guarded, servers, "gh.test", {"Authorization": "cir-secret://PATHED"}, path=path
    )
    assert reply.status == 200, reply.head
    expected = VALUE if outcome == SUBSTITUTED else "cir-secret://PATHED"
    assert servers.seen["api"][0]["headers"]["authorization"] == expected
    (record,) = await guarded.records(1)
    assert record.credentials == (("PATHED", outcome),)


async def test_placeholders_are_noted_once_in_the_record_and_never_logged_per_request(
    guarded: Running,
    servers: Servers,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A head full of made-up names: one entry in the record, no warning in the log."""
    caplog.set_level(logging.DEBUG)
    made_up = ",".join(f"cir-secret://FAKE_{i}" for i in range(300))
    headers = {"X-Many": made_up, "Idempotency-Key": "cir-secret://OPENAI_KEY"}
    reply = await _send(guarded, servers, "api.test", headers)
    assert reply.status == 200, reply.head
    (record,) = await guarded.records(1)
    assert len(record.credentials) <= MAX_OUTCOMES
    assert record.credentials == (
        ("OPENAI_KEY", HEADER_NOT_BOUND),
        ("<300 unknown names>", UNKNOWN_NAME),
    )
    assert "FAKE_" not in caplog.text and "not swapped" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_client_hello_sent_before_the_proxys_200_is_answered_400_at_once(
    start_proxy: StartProxy, tmp_path: Path
) -> None:
    """The upstream is slow to shake hands, and the client sends its first TLS bytes while the
    proxy waits for it (after the CONNECT head was read): those bytes sit in the proxy's reader,
    where starting TLS would lose them (and the handshake would hang until its timeout)."""
    public = generate_ca("slow public CA")
    ca_file = tmp_path / "public-ca.pem"
    ca_file.write_bytes(public.cert_pem)
    cert, key = _issue(public, ["slow.test"], tmp_path, "slow")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def slow() -> None:
        """Accepts, waits a second, then shakes hands (TLS), reads a little, and closes."""
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                time.sleep(1.0)
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(5)
                    tls.recv(65536)

    thread = threading.Thread(target=slow, daemon=True)
    thread.start()
    deployment = generate_ca()
    running = await start_proxy(
        {"allow": [{"host": "slow.test", "ports": [port]}]},
        resolve_overrides={"slow.test": ("127.0.0.1",)},
        private_hosts=frozenset({f"slow.test:{port}"}),
        upstream_ca_file=ca_file,
        credentials=CredentialBindings(
            [CredentialBinding("OPENAI_KEY", VALUE, hosts=("slow.test",))]
        ),
        interceptor=TlsInterceptor(deployment.cert_pem, deployment.key_pem),
    )
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
        started = time.monotonic()
        writer.write(
            f"CONNECT slow.test:{port} HTTP/1.1\r\nHost: slow.test:{port}\r\n\r\n".encode()
        )
        await writer.drain()
        await asyncio.sleep(0.3)  # the proxy has read the head and is shaking hands upstream
        writer.write(b"\x16\x03\x01\x00\x05early")  # the start of a ClientHello
        await writer.drain()
        async with asyncio.timeout(15):
            answer = await reader.read(-1)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert b"before the proxy's answer to CONNECT" in answer
        assert time.monotonic() - started < 10  # not the handshake's 20 s timeout
        (record,) = await running.records(1)
        assert not record.allowed and "wait for its 200" in record.reason
    finally:
        listener.close()
        thread.join(10)
