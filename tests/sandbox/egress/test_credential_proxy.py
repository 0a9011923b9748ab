"""Credential substitution through the proxy, all on loopback: HTTPS servers with certificates
of a test "public" CA (given to the proxy as `upstream_ca_file`), one with a certificate of a CA
nobody trusts, and a plain HTTP server, each recording the headers it received. The sandbox's
side is a raw client (and curl) that trusts the deployment's egress CA only."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import ssl
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sandbox.egress.credentials import (
    HOST_NOT_BOUND,
    METHOD_NOT_BOUND,
    PATH_NOT_BOUND,
    PLAIN_HTTP,
    SUBSTITUTED,
    CredentialBinding,
    CredentialBindings,
)
from sandbox.egress.interception import GeneratedCa, TlsInterceptor, generate_ca
from tests.sandbox.egress.conftest import Running, StartProxy, curl

VALUE = "sk-real-4f1c9a7e2b"
GH_VALUE = "ghp-real-77aa33"
PLACEHOLDER = "cir-secret://OPENAI_KEY"


class Recorder(BaseHTTPRequestHandler):
    """Records each request's method, path and headers on its server, and echoes them."""

    protocol_version = "HTTP/1.1"
    server: RecordingServer

    def log_message(self, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
        }
        self.server.seen.append(seen)
        payload = json.dumps({**seen, "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_TRACE = _handle


class RecordingServer(ThreadingHTTPServer):
    seen: list[dict[str, Any]]


@dataclass
class Servers:
    api_tls: int  # api.test and other.test, certificate of the trusted test CA
    bad_tls: int  # badcert.test, certificate of an untrusted CA
    plain: int
    upstream_ca_file: Path
    deployment_ca_file: Path
    deployment: GeneratedCa
    seen: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _issue(ca: GeneratedCa, names: list[str], directory: Path, stem: str) -> tuple[str, str]:
    """A server certificate for `names`, signed by `ca`; its cert and key files."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        public, untrusted, deployment = generate_ca("test public CA"), generate_ca(), generate_ca()
        (directory / "public-ca.pem").write_bytes(public.cert_pem)
        (directory / "deployment-ca.pem").write_bytes(deployment.cert_pem)
        made: dict[str, RecordingServer] = {}
        for label, ca, names in (
            ("api", public, ["api.test", "other.test", "gh.test"]),
            ("bad", untrusted, ["badcert.test"]),
            ("plain", None, []),
        ):
            server = RecordingServer(("127.0.0.1", 0), Recorder)
            server.seen = []
            if ca is not None:
                cert, key = _issue(ca, names, directory, label)
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                context.load_cert_chain(cert, key)
                server.socket = context.wrap_socket(server.socket, server_side=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            made[label] = server
        try:
            yield Servers(
                api_tls=made["api"].server_address[1],
                bad_tls=made["bad"].server_address[1],
                plain=made["plain"].server_address[1],
                upstream_ca_file=directory / "public-ca.pem",
                deployment_ca_file=directory / "deployment-ca.pem",
                deployment=deployment,
                seen={label: server.seen for label, server in made.items()},
            )
        finally:
            for server in made.values():
                server.shutdown()
                server.server_close()


@pytest.fixture
async def running(start_proxy: StartProxy, servers: Servers) -> Running:
    for seen in servers.seen.values():
        seen.clear()
    names = ("api.test", "other.test", "badcert.test", "gh.test")
    ports = (servers.api_tls, servers.bad_tls, servers.plain)
    secrets = CredentialBindings(
        [
            CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test", "badcert.test")),
            CredentialBinding(
                "GH_TOKEN", GH_VALUE, hosts=("gh.test",), methods=("POST",), path_prefixes=("/v1/",)
            ),
        ]
    )
    return await start_proxy(
        {"allow": [{"host": name, "ports": list(ports)} for name in names]},
        resolve_overrides={name: ("127.0.0.1",) for name in names},
        private_hosts=frozenset(f"{name}:{port}" for name in names for port in ports),
        upstream_ca_file=servers.upstream_ca_file,
        credentials=secrets,
        interceptor=TlsInterceptor(servers.deployment.cert_pem, servers.deployment.key_pem),
    )


def _request(
    method: str, target: str, host: str, headers: dict[str, str], body: bytes = b""
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Reply:
    head: bytes
    body: bytes
    peer_cert: x509.Certificate | None = None

    @property
    def status(self) -> int:
        return int(self.head.split(b" ", 2)[1])

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.body)
        return data


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    async with asyncio.timeout(30):
        data = await reader.read(-1)
    head, _, body = data.partition(b"\r\n\r\n")
    return Reply(head, body)


async def https_via_proxy(
    running: Running, host: str, port: int, cafile: Path, request: bytes
) -> Reply:
    """CONNECT through the proxy, then TLS trusting `cafile` only, then one request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    try:
        writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            rest = await _read_reply(reader)
            return Reply(head, rest.head)
        context = ssl.create_default_context(cafile=str(cafile))
        await writer.start_tls(context, server_hostname=host)
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        writer.write(request)
        reply = await _read_reply(reader)
        reply.peer_cert = x509.load_der_x509_certificate(der)
        return reply
    finally:
        writer.close()


async def plain_via_proxy(running: Running, request: bytes) -> Reply:
    reader, writer = await asyncio.open_connection("127.0.0.1", running.relay_port)
    try:
        writer.write(request)
        return await _read_reply(reader)
    finally:
        writer.close()


def _never_the_value(running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """(g) No record, log line or captured log holds a secret's value."""
    for record in running.ledger.records:
        for text in (repr(record), record.describe("s-test")):
            assert VALUE not in text and GH_VALUE not in text
    assert VALUE not in caplog.text and GH_VALUE not in caplog.text


async def test_https_to_a_bound_host_gets_the_real_value_under_a_minted_certificate(
    running: Running, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """(a) The server receives the value where the client sent the placeholder; the client
    verified the proxy's certificate for api.test against the deployment's CA alone."""
    caplog.set_level(logging.DEBUG)
    request = _request(
        "GET",
        "/v1/models",
        f"api.test:{servers.api_tls}",
        {"Authorization": f"Bearer {PLACEHOLDER}"},
    )
    reply = await https_via_proxy(
        running, "api.test", servers.api_tls, servers.deployment_ca_file, request
    )
    assert reply.status == 200, reply.head
    (seen,) = servers.seen["api"]
    assert seen["headers"]["authorization"] == f"Bearer {VALUE}"
    assert seen["path"] == "/v1/models" and seen["headers"]["host"] == f"api.test:{servers.api_tls}"
    assert reply.peer_cert is not None
    deployment = x509.load_pem_x509_certificate(servers.deployment.cert_pem)
    reply.peer_cert.verify_directly_issued_by(deployment)
    alt = reply.peer_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt.get_values_for_type(x509.DNSName) == ["api.test"]
    (record,) = await running.records(1)
    assert record.method == "CONNECT" and record.allowed and record.host == "api.test"
    assert record.credentials == (("OPENAI_KEY", SUBSTITUTED),)
    assert "TLS terminated" in record.reason and record.bytes_up > 0 and record.bytes_down > 0
    assert "credentials=[OPENAI_KEY: substituted]" in record.describe("s-test")
    _never_the_value(running, caplog)


async def test_curl_through_a_terminated_tunnel(running: Running, servers: Servers) -> None:
    """A real client: curl trusting the deployment's CA, a POST with a body."""
    code, out, err = await curl(
        "--cacert", str(servers.deployment_ca_file), "-x", running.url,
        "-H", f"Authorization: Bearer {PLACEHOLDER}", "--data", "hello",
        f"https://api.test:{servers.api_tls}/v1/chat",
    )  # fmt: skip
    assert code == 0, err
    answer = json.loads(out)
    assert answer["method"] == "POST" and answer["body"] == "hello"
    assert servers.seen["api"][0]["headers"]["authorization"] == f"Bearer {VALUE}"


async def test_requests_reuses_its_session_across_terminated_tunnels(
    running: Running, servers: Servers
) -> None:
    """A real client, two requests in one session: each tunnel carries one request (the proxy
    answers `Connection: close`), and requests opens the next one itself."""

    def fetch() -> list[int]:
        with requests.Session() as session:
            session.trust_env = False
            session.proxies = {"https": running.url}
            session.verify = str(servers.deployment_ca_file)
            headers = {"Authorization": f"Bearer {PLACEHOLDER}"}
            url = f"https://api.test:{servers.api_tls}/v1/models"
            return [session.get(url, headers=headers, timeout=30).status_code for _ in range(2)]

    assert await asyncio.to_thread(fetch) == [200, 200]
    assert [s["headers"]["authorization"] for s in servers.seen["api"]] == [f"Bearer {VALUE}"] * 2
    records = await running.records(2)
    assert all(r.credentials == (("OPENAI_KEY", SUBSTITUTED),) for r in records)


async def test_a_client_not_trusting_the_deployment_ca_sends_nothing(
    running: Running, servers: Servers
) -> None:
    request = _request("GET", "/", "api.test", {"Authorization": f"Bearer {PLACEHOLDER}"})
    with pytest.raises(ssl.SSLCertVerificationError):
        await https_via_proxy(
            running, "api.test", servers.api_tls, servers.upstream_ca_file, request
        )
    (record,) = await running.records(1)
    assert "TLS with the proxy failed" in record.reason and record.credentials == ()
    assert servers.seen["api"] == []


async def test_the_placeholder_to_an_unbound_host_arrives_unchanged_and_is_recorded(
    running: Running, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """(b) other.test is allowed but no secret is bound to it: plain HTTP carries the
    placeholder unchanged (recorded), and HTTPS to it stays an opaque tunnel with the server's
    own certificate."""
    caplog.set_level(logging.DEBUG)
    reply = await plain_via_proxy(
        running,
        _request(
            "GET",
            f"http://other.test:{servers.plain}/steal",
            f"other.test:{servers.plain}",
            {"Authorization": f"Bearer {PLACEHOLDER}"},
        ),
    )
    assert reply.status == 200
    assert servers.seen["plain"][0]["headers"]["authorization"] == f"Bearer {PLACEHOLDER}"
    # An opaque tunnel: the server's keep-alive is the client's to end.
    headers = {"X-Key": PLACEHOLDER, "Connection": "close"}
    request = _request("GET", "/", f"other.test:{servers.api_tls}", headers)
    tls = await https_via_proxy(
        running, "other.test", servers.api_tls, servers.upstream_ca_file, request
    )
    assert tls.status == 200 and tls.peer_cert is not None
    public = x509.load_pem_x509_certificate(servers.upstream_ca_file.read_bytes())
    tls.peer_cert.verify_directly_issued_by(public)  # the server's own, not a minted one
    assert servers.seen["api"][0]["headers"]["x-key"] == PLACEHOLDER
    plain_record, tunnel_record = await running.records(2)
    assert plain_record.credentials == (("OPENAI_KEY", HOST_NOT_BOUND),)
    line = plain_record.describe("s-test")
    assert "credentials=[OPENAI_KEY: sent unchanged: host not bound]" in line
    assert tunnel_record.credentials == () and "TLS terminated" not in tunnel_record.reason
    # Noted in the connection's record only: no log line per request (a sandbox could flood it).
    assert "not swapped" not in caplog.text and "OPENAI_KEY" not in caplog.text
    _never_the_value(running, caplog)


async def test_plain_http_to_a_bound_host_is_never_given_the_value(
    running: Running, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """(c) Plain HTTP to a bound host: anyone on the way could read it, so the placeholder
    goes as it is, and the record says why."""
    caplog.set_level(logging.DEBUG)
    reply = await plain_via_proxy(
        running,
        _request(
            "GET",
            f"http://api.test:{servers.plain}/v1/x",
            f"api.test:{servers.plain}",
            {"X-Api-Key": PLACEHOLDER, "Connection": "keep-alive"},
        ),
    )
    assert reply.status == 200
    assert servers.seen["plain"][0]["headers"]["x-api-key"] == PLACEHOLDER
    (record,) = await running.records(1)
    assert record.credentials == (("OPENAI_KEY", PLAIN_HTTP),)
    _never_the_value(running, caplog)


@pytest.mark.parametrize(
    ("method", "path", "outcome"),
    [
        ("GET", "/v1/repos", METHOD_NOT_BOUND),
        ("POST", "/v2/repos", PATH_NOT_BOUND),
        ("POST", "/v1/../admin", PATH_NOT_BOUND),
        ("POST", "/v1/repos", SUBSTITUTED),
    ],
)
async def test_methods_and_paths_not_bound_leave_the_placeholder(
    running: Running,
    servers: Servers,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    outcome: str,
) -> None:
    """(d) GH_TOKEN goes only in a POST under /v1/ to gh.test."""
    caplog.set_level(logging.DEBUG)
    authority = f"gh.test:{servers.api_tls}"
    request = _request(method, path, authority, {"Authorization": "token cir-secret://GH_TOKEN"})
    reply = await https_via_proxy(
        running, "gh.test", servers.api_tls, servers.deployment_ca_file, request
    )
    assert reply.status == 200, reply.head
    received = servers.seen["api"][0]["headers"]["authorization"]
    assert received == (
        f"token {GH_VALUE}" if outcome == SUBSTITUTED else "token cir-secret://GH_TOKEN"
    )
    (record,) = await running.records(1)
    assert record.credentials == (("GH_TOKEN", outcome),)
    _never_the_value(running, caplog)


async def test_an_upstream_certificate_that_does_not_verify_is_refused_before_anything_is_sent(
    running: Running, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """(h) badcert.test is bound, but its certificate is of a CA the proxy does not trust: the
    CONNECT is answered 502, the sandbox never gets to send its request, nothing is swapped."""
    caplog.set_level(logging.DEBUG)
    request = _request("GET", "/", "badcert.test", {"Authorization": f"Bearer {PLACEHOLDER}"})
    reply = await https_via_proxy(
        running, "badcert.test", servers.bad_tls, servers.deployment_ca_file, request
    )
    assert reply.status == 502 and reply.peer_cert is None
    assert b"did not verify" in reply.head + reply.body
    assert VALUE.encode() not in reply.head + reply.body
    assert servers.seen["bad"] == []
    (record,) = await running.records(1)
    assert not record.allowed and record.credentials == ()
    assert "certificate of badcert.test" in record.reason and "did not verify" in record.reason
    _never_the_value(running, caplog)


async def test_inside_a_terminated_tunnel_the_request_cannot_point_elsewhere(
    running: Running, servers: Servers
) -> None:
    """A Host header or an absolute target naming another host is refused inside the tunnel,
    before any substitution."""
    for request in (
        _request("GET", "/", f"other.test:{servers.api_tls}", {"X-Key": PLACEHOLDER}),
        _request(
            "GET",
            f"https://other.test:{servers.api_tls}/",
            f"api.test:{servers.api_tls}",
            {"X-Key": PLACEHOLDER},
        ),
    ):
        reply = await https_via_proxy(
            running, "api.test", servers.api_tls, servers.deployment_ca_file, request
        )
        assert reply.status in (400, 403), reply.head
    assert servers.seen["api"] == []
    records = await running.records(2)
    assert all(r.credentials == () for r in records)


async def test_without_an_interceptor_https_to_a_bound_host_stays_an_opaque_tunnel(
    start_proxy: StartProxy, servers: Servers
) -> None:
    """Secrets but no CA: CONNECTs are never terminated, so the placeholder goes unchanged
    inside the client's own TLS (and plain HTTP never gets a value either): nothing is swapped
    anywhere."""
    for seen in servers.seen.values():
        seen.clear()
    running = await start_proxy(
        {"allow": [{"host": "api.test", "ports": [servers.api_tls]}]},
        resolve_overrides={"api.test": ("127.0.0.1",)},
        private_hosts=frozenset({f"api.test:{servers.api_tls}"}),
        credentials=CredentialBindings(
            [CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test",))]
        ),
    )
    headers = {"Authorization": f"Bearer {PLACEHOLDER}", "Connection": "close"}
    request = _request("GET", "/", f"api.test:{servers.api_tls}", headers)
    reply = await https_via_proxy(
        running, "api.test", servers.api_tls, servers.upstream_ca_file, request
    )
    assert reply.status == 200
    assert servers.seen["api"][0]["headers"]["authorization"] == f"Bearer {PLACEHOLDER}"
    (record,) = await running.records(1)
    assert record.credentials == () and "TLS terminated" not in record.reason
