"""HTTPS of a session with secrets to a host none of them is bound to: inspected on the ports
the operator lists, so a placeholder sent there is noted (and goes out unchanged); left an
opaque tunnel, and said so, wherever the proxy cannot look (sandbox/egress/exchange.py)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from sandbox.egress.credentials import (
    HOST_NOT_BOUND,
    SUBSTITUTED,
    UNKNOWN_NAME,
    CredentialBinding,
    CredentialBindings,
)
from sandbox.egress.interception import TlsInterceptor
from sandbox.egress.placeholder_scan import MAX_UNKNOWN, PlaceholderScanner
from tests.sandbox.egress.conftest import Running, StartProxy
from tests.sandbox.egress.test_credential_proxy import (
    GH_VALUE,
    VALUE,
    Servers,
    _never_the_value,
    _request,
    https_via_proxy,
    servers,  # noqa: F401  (the module's fixture)
)

NAMES = ("api.test", "other.test", "badcert.test", "gh.test")


async def _proxy(start_proxy: StartProxy, servers: Servers, **settings: object) -> Running:  # noqa: F811
    for seen in servers.seen.values():
        seen.clear()
    ports = (servers.api_tls, servers.bad_tls, servers.plain)
    secrets = CredentialBindings(
        [
            CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test",)),
            CredentialBinding("GH_TOKEN", GH_VALUE, hosts=("gh.test",)),
        ]
    )
    return await start_proxy(
        {"allow": [{"host": name, "ports": list(ports)} for name in NAMES]},
        resolve_overrides={name: ("127.0.0.1",) for name in NAMES},
        private_hosts=frozenset(f"{name}:{port}" for name in NAMES for port in ports),
        upstream_ca_file=servers.upstream_ca_file,
        credentials=secrets,
        interceptor=TlsInterceptor(servers.deployment.cert_pem, servers.deployment.key_pem),
        **settings,
    )


def _issued_by(cert: x509.Certificate, ca_file: Path) -> bool:
    try:
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_file.read_bytes()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


async def _connected(
    running: Running, where: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection through the proxy, its CONNECT to `where` answered 200."""
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    writer.write(f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n\r\n".encode())
    async with asyncio.timeout(30):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    return reader, writer


async def test_https_to_an_unbound_host_is_inspected_relayed_unchanged_and_noted(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    running = await _proxy(start_proxy, servers, inspected_ports=frozenset({servers.api_tls}))
    where = f"other.test:{servers.api_tls}"
    reader, writer = await _connected(running, where)
    try:
        context = ssl.create_default_context(cafile=str(servers.deployment_ca_file))
        await writer.start_tls(context, server_hostname="other.test")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        # Two requests on the one connection (a relay, not one request per tunnel): the first
        # with placeholders in a header, the second in its body, one split over two writes.
        first = _request(
            "GET",
            "/one",
            where,
            {"X-Key": "cir-secret://OPENAI_KEY", "X-Made": "cir-secret://NOPE"},
        )
        writer.write(first)
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        body = b"token=cir-secret://GH_TOKEN&x=1"
        second = _request("POST", "/two", where, {"Connection": "close"}, body)
        cut = second.index(b"GH_TO")
        writer.write(second[:cut])
        await writer.drain()
        writer.write(second[cut:])
        async with asyncio.timeout(30):
            rest = await reader.read(-1)
        assert rest.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    # The sandbox was shown a certificate minted under the deployment's CA...
    assert _issued_by(x509.load_der_x509_certificate(der), servers.deployment_ca_file)
    # ...and the server received the placeholders as they were sent.
    seen = servers.seen["api"]
    assert [s["path"] for s in seen] == ["/one", "/two"]
    assert seen[0]["headers"]["x-key"] == "cir-secret://OPENAI_KEY"
    (record,) = await running.records(1)
    assert "TLS inspected by the proxy" in record.reason
    assert record.credentials == (
        ("OPENAI_KEY", HOST_NOT_BOUND),
        ("GH_TOKEN", HOST_NOT_BOUND),
        ("NOPE", UNKNOWN_NAME),  # made-up names last, as for every record
    )
    assert "OPENAI_KEY: sent unchanged: host not bound" in record.describe("s-test")
    _never_the_value(running, caplog)


async def test_an_inspected_tunnel_ends_when_the_sandbox_closes_it(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    """A keep-alive server never closes first: the sandbox's close ends the tunnel (TLS cannot
    pass a half-close on), so its connection slot is free again at once, not after the idle
    time (300 s here). Each of three requests, one connection at a time allowed, waits only for
    the record of the one before."""
    running = await _proxy(
        start_proxy,
        servers,
        inspected_ports=frozenset({servers.api_tls}),
        max_connections_per_session=1,
    )
    where = f"other.test:{servers.api_tls}"
    context = ssl.create_default_context(cafile=str(servers.deployment_ca_file))
    for n in range(1, 4):
        reader, writer = await _connected(running, where)
        try:
            await writer.start_tls(context, server_hostname="other.test")
            writer.write(_request("GET", f"/kept-alive/{n}", where, {}))
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
        finally:
            writer.close()
        records = await running.records(n)  # within 30 s, far less than the idle time
        assert "TLS inspected" in records[-1].reason and records[-1].allowed
        assert "no byte either way" not in records[-1].reason
    assert [s["path"] for s in servers.seen["api"]] == [f"/kept-alive/{n}" for n in (1, 2, 3)]


async def test_a_bound_host_is_still_terminated_and_given_its_value(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    running = await _proxy(start_proxy, servers, inspected_ports=frozenset({servers.api_tls}))
    request = _request(
        "GET", "/bound", f"api.test:{servers.api_tls}", {"X-Api-Key": "cir-secret://OPENAI_KEY"}
    )
    reply = await https_via_proxy(
        running, "api.test", servers.api_tls, servers.deployment_ca_file, request
    )
    assert reply.status == 200
    assert servers.seen["api"][0]["headers"]["x-api-key"] == VALUE
    (record,) = await running.records(1)
    assert record.credentials == (("OPENAI_KEY", SUBSTITUTED),)


async def test_a_port_not_inspected_stays_an_opaque_tunnel(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    running = await _proxy(start_proxy, servers)  # the default: 443 only
    where = f"other.test:{servers.api_tls}"
    request = _request(
        "GET", "/", where, {"X-Key": "cir-secret://OPENAI_KEY", "Connection": "close"}
    )
    reply = await https_via_proxy(
        running, "other.test", servers.api_tls, servers.upstream_ca_file, request
    )
    assert reply.status == 200 and reply.peer_cert is not None
    assert _issued_by(reply.peer_cert, servers.upstream_ca_file)  # the server's own
    (record,) = await running.records(1)
    assert record.credentials == () and "inspected" not in record.reason


async def test_a_host_the_proxy_cannot_verify_gets_an_opaque_tunnel_and_the_record_says_so(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    running = await _proxy(start_proxy, servers, inspected_ports=frozenset({servers.bad_tls}))
    where = f"badcert.test:{servers.bad_tls}"
    reader, writer = await _connected(running, where)
    try:
        # The sandbox's own TLS reaches the server (which it may trust by its own means).
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        await writer.start_tls(context, server_hostname="badcert.test")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(_request("GET", "/own", where, {"Connection": "close"}))
        async with asyncio.timeout(30):
            assert (await reader.read(-1)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    assert not _issued_by(x509.load_der_x509_certificate(der), servers.deployment_ca_file)
    (record,) = await running.records(1)
    assert "not inspected by the proxy: the certificate of badcert.test" in record.reason
    assert record.allowed and record.credentials == ()
    # No certificate was minted for it: only a host that verified gets one.
    interceptor = running.proxy.interceptor
    assert interceptor is not None and "badcert.test" not in interceptor.cached_hosts


async def test_the_new_hosts_a_session_has_its_tls_ended_for_are_paced(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    """Past its new hosts a minute, a session's HTTPS to another new host stays opaque (and
    says so), to a new bound host is refused 429; a host of its already is taken still, however
    many connections reach it at once. Its count goes with its proxy."""
    names = ("api.test", "other.test", "gh.test")
    interceptor = TlsInterceptor(
        servers.deployment.cert_pem, servers.deployment.key_pem, new_hosts_per_minute=1
    )
    bindings = [CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test",))]
    running = await start_proxy(
        {"allow": [{"host": name, "ports": [servers.api_tls]} for name in names]},
        resolve_overrides={name: ("127.0.0.1",) for name in names},
        private_hosts=frozenset(f"{name}:{servers.api_tls}" for name in names),
        upstream_ca_file=servers.upstream_ca_file,
        credentials=CredentialBindings(bindings),
        interceptor=interceptor,
        inspected_ports=frozenset({servers.api_tls}),
    )

    async def get(host: str, trusted: Path) -> int:
        request = _request("GET", "/", f"{host}:{servers.api_tls}", {"Connection": "close"})
        reply = await https_via_proxy(running, host, servers.api_tls, trusted, request)
        return reply.status

    try:
        # Four connections at once to one new host: one host, counted once, all inspected.
        statuses = await asyncio.gather(
            *(get("other.test", servers.deployment_ca_file) for _ in range(4))
        )
        assert statuses == [200] * 4
        # Another new host: its minute is used up, so an opaque tunnel (the server's own
        # certificate, which the client trusts here); a new bound host is refused.
        assert await get("gh.test", servers.upstream_ca_file) == 200
        assert await get("api.test", servers.deployment_ca_file) == 429
        assert await get("other.test", servers.deployment_ca_file) == 200  # its own still
        records = await running.records(7)
        assert ["TLS inspected" in r.reason for r in records[:4]] == [True] * 4
        assert "not inspected by the proxy: over 1 new hosts for the session" in records[4].reason
        assert "over 1 new hosts whose TLS the proxy ends" in records[5].reason
        assert not records[5].allowed and "TLS inspected" in records[6].reason
        assert interceptor.cached_hosts == ("other.test",)
        assert not interceptor.may_take("s-test", "api.test")
        await running.proxy.close()
        assert interceptor.may_take("s-test", "api.test")  # forgotten with its proxy
    finally:
        interceptor.close()


async def test_a_server_not_speaking_tls_gets_an_opaque_tunnel(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    running = await _proxy(start_proxy, servers, inspected_ports=frozenset({servers.plain}))
    where = f"other.test:{servers.plain}"
    reader, writer = await _connected(running, where)
    try:
        writer.write(_request("GET", "/plain-in-tunnel", where, {"Connection": "close"}))
        async with asyncio.timeout(30):
            assert (await reader.read(-1)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    # The proxy's own try spoke TLS on another connection: the tunnel's was new.
    assert [s["path"] for s in servers.seen["plain"]] == ["/plain-in-tunnel"]
    (record,) = await running.records(1)
    assert f"not inspected by the proxy: TLS with {where} failed" in record.reason


async def test_bytes_sent_before_the_answer_leave_the_tunnel_opaque(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    """A client that sends its ClientHello with its CONNECT (not waiting for the 200) gets an
    opaque tunnel: TLS ended here would lose those bytes."""
    running = await _proxy(start_proxy, servers, inspected_ports=frozenset({servers.api_tls}))
    where = f"other.test:{servers.api_tls}"
    context = ssl.create_default_context(cafile=str(servers.upstream_ca_file))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="other.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    try:
        writer.write(f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n\r\n".encode() + hello)
        async with asyncio.timeout(30):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            while True:  # the handshake over the memory BIOs, through the tunnel
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    writer.write(outgoing.read())
                    incoming.write(await reader.read(65536))
            writer.write(outgoing.read())
            tls.write(_request("GET", "/early", where, {"Connection": "close"}))
            writer.write(outgoing.read())
            answer = b""
            while not answer.startswith(b"HTTP/1.1 200"):
                incoming.write(await reader.read(65536))
                try:
                    answer += tls.read(65536)
                except ssl.SSLWantReadError:
                    continue
    finally:
        writer.close()
    der = tls.getpeercert(binary_form=True)
    assert der is not None and _issued_by(
        x509.load_der_x509_certificate(der), servers.upstream_ca_file
    )
    (record,) = await running.records(1)
    assert "not inspected by the proxy: bytes were sent before" in record.reason


async def test_a_session_without_secrets_is_never_inspected(
    start_proxy: StartProxy,
    servers: Servers,  # noqa: F811
) -> None:
    where = f"other.test:{servers.api_tls}"
    running = await start_proxy(
        {"allow": [{"host": "other.test", "ports": [servers.api_tls]}]},
        resolve_overrides={"other.test": ("127.0.0.1",)},
        private_hosts=frozenset({where}),
        upstream_ca_file=servers.upstream_ca_file,
        interceptor=TlsInterceptor(servers.deployment.cert_pem, servers.deployment.key_pem),
        inspected_ports=frozenset({servers.api_tls}),
    )
    request = _request("GET", "/", where, {"Connection": "close"})
    reply = await https_via_proxy(
        running, "other.test", servers.api_tls, servers.upstream_ca_file, request
    )
    assert reply.status == 200 and reply.peer_cert is not None
    assert _issued_by(reply.peer_cert, servers.upstream_ca_file)
    (record,) = await running.records(1)
    assert "inspected" not in record.reason


def test_the_scanner_finds_placeholders_split_anywhere_and_only_whole_names() -> None:
    stream = (
        b"a cir-secret://OPENAI_KEY b cir-secret://GH_TOKENx q=cir-secret%3a%2F%2FQUERY&"
        b'j="cir-secret:\\/\\/JSON" /p/cir-secret%3A//PATH cir-secret://LAST'
    )
    for size in (1, 2, 3, 7, 64):
        scanner = PlaceholderScanner(["OPENAI_KEY", "LAST"])
        for at in range(0, len(stream), size):
            scanner.feed(stream[at : at + size])
        scanner.close()
        # GH_TOKENx runs on in a name character: not a placeholder. The session's own names
        # first; a percent-encoded one (a query string) and a JSON-escaped one are seen too.
        assert scanner.names == ("OPENAI_KEY", "LAST", "QUERY", "JSON", "PATH"), size
        assert scanner.unknown_beyond == 0, size


def test_made_up_names_cannot_hide_the_sessions_own_and_memory_stays_bounded() -> None:
    scanner = PlaceholderScanner(["REAL"])
    for n in range(MAX_UNKNOWN * 4):
        scanner.feed(f"cir-secret://FAKE{n} ".encode())
    scanner.feed(b"cir-secret://REAL ")
    scanner.close()
    assert scanner.names == ("REAL", *(f"FAKE{n}" for n in range(MAX_UNKNOWN)))
    assert scanner.unknown_beyond == MAX_UNKNOWN * 3
    assert len(scanner._tail) == 0
    bindings = CredentialBindings([CredentialBinding("REAL", VALUE, hosts=("api.test",))])
    outcomes = bindings.unbound_outcomes(scanner.names, scanner.unknown_beyond)
    assert outcomes == (
        ("REAL", HOST_NOT_BOUND),
        (f"<more than {MAX_UNKNOWN} unknown names>", UNKNOWN_NAME),
    )
