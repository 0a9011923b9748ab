"""A session's secret substituted end to end: a real server on 127.0.0.1, a sandbox of each
backend the service tests use (local, docker), and an HTTPS server on loopback with a test CA
of its own (given to the egress proxy as its upstream CA). The server receives the real key;
the sandbox holds only the placeholder; to a host the secret is not bound to, the placeholder
goes out unchanged."""

from __future__ import annotations

import datetime
import http.server
import json
import shutil
import signal
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandbox.egress.interception import generate_ca
from tests.conftest import require_backend
from tests.orchestrator.service.conftest import Server, free_port, make_server, service_backends

VALUE = "sk-e2e-4b9d0c2a7f1e6d3b-never-in-the-sandbox"
HOSTS = ("api.test", "other.test")


@dataclass
class Https:
    port: int
    ca_file: Path
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (host, path, authorization)


def _leaf(ca_cert_pem: bytes, ca_key_pem: bytes) -> tuple[bytes, bytes]:
    """A server certificate for HOSTS under the test CA."""
    ca = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTS[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in HOSTS]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture(scope="module")
def https(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Https]:
    directory = tmp_path_factory.mktemp("https")
    ca = generate_ca("test upstream CA")
    cert, key = _leaf(ca.cert_pem, ca.key_pem)
    (directory / "ca.pem").write_bytes(ca.cert_pem)
    (directory / "ca.pem").chmod(0o644)
    (directory / "cert.pem").write_bytes(cert)
    (directory / "key.pem").write_bytes(key)
    server = Https(free_port(), directory / "ca.pem")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            auth = (
                self.headers.get("Authorization")
                or self.headers.get("X-Key")
                or self.headers.get("X-Echo")
                or ""
            )
            server.seen.append((self.headers.get("Host", ""), self.path, auth))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", server.port), Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(https: Https) -> Iterator[Server]:
    require_backend("local")
    srv = make_server(
        network_ceiling="any",
        egress_resolve=",".join(f"{h}=127.0.0.1" for h in HOSTS),
        egress_private_hosts=",".join(f"{h}:{https.port}" for h in HOSTS),
        egress_upstream_ca_file=https.ca_file,
        # The test server's port stands for 443: HTTPS to an unbound host there is inspected.
        egress_inspected_ports=https.port,
    )
    srv.start()
    try:
        yield srv
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)
        assert VALUE not in srv.log.read_text(), "a secret's value was logged"
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert reply.status_code == 200, reply.text
    assert reply.json()["error"] is None, reply.json()["error"]
    return str(reply.json()["stdout"])


@pytest.fixture(params=service_backends())
def session(
    request: pytest.FixtureRequest, server: Server, https: Https
) -> Iterator[tuple[httpx.Client, str]]:
    https.seen.clear()  # what this session's requests brought, only
    with server.client() as api:
        stored = api.post(
            "/v1/secrets",
            json={
                "name": "API_KEY",
                "value": VALUE,
                "hosts": [HOSTS[0]],
                "headers": ["Authorization", "X-Key"],
            },
        )
        assert stored.status_code == 201, stored.text
        network = [f"{h}:{https.port}" for h in HOSTS]
        created = api.post(
            "/v1/sessions",
            json={"backend": request.param, "network": network, "secrets": ["API_KEY"]},
        )
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            yield api, sid
        finally:
            api.delete(f"/v1/sessions/{sid}")
            api.delete("/v1/secrets/API_KEY")


def test_the_bound_host_receives_the_value_and_the_sandbox_only_the_placeholder(
    https: Https, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    url = f"https://{HOSTS[0]}:{https.port}"
    code = (
        "import os, requests\n"
        "auth = {'Authorization': 'Bearer ' + os.environ['API_KEY']}\n"
        f"r = requests.get('{url}/requests', headers=auth, timeout=60)\n"
        "print(r.status_code, r.text)\n"
    )
    assert run(api, sid, code).strip() == "200 ok"
    curl = api.post(
        f"/v1/sessions/{sid}/commands",
        json={"command": f'curl -sS -H "Authorization: Bearer $API_KEY" {url}/curl'},
    ).json()
    assert (curl["exit_code"], curl["stdout"]) == (0, "ok"), curl
    received = {path: auth for host, path, auth in https.seen if host.startswith(HOSTS[0])}
    assert received["/requests"] == f"Bearer {VALUE}"
    assert received["/curl"] == f"Bearer {VALUE}"

    # What the sandbox holds: the placeholder only, in its environment, files and processes.
    look = (
        "import os, pathlib\n"
        "found = []\n"
        # In halves, and deleted after: the audit log keeps the code, a pause the variables.
        f"needle = {VALUE[:10].encode()!r} + {VALUE[10:].encode()!r}\n"
        "procs = map(str, pathlib.Path('/proc').glob('[0-9]*/environ'))\n"
        "for p in ['/proc/self/environ', *procs]:\n"
        "    try:\n"
        "        found += [p] if needle in pathlib.Path(p).read_bytes() else []\n"
        "    except OSError:\n"
        "        pass\n"
        "for root in ('/run/egress', '/workspace', '/tmp'):\n"
        "    for p in pathlib.Path(root).rglob('*'):\n"
        "        try:\n"
        "            found += [str(p)] if p.is_file() and needle in p.read_bytes() else []\n"
        "        except OSError:\n"
        "            pass\n"
        "del needle\n"
        "print(os.environ['API_KEY'], found)\n"
    )
    assert run(api, sid, look).strip() == "cir-secret://API_KEY []"
    # And its memory: the kernel that made the request dumps every region it can read, and
    # looks for the value as a first half followed by the second (never whole in its memory).
    dump = (
        "import re\n"
        f"first, second = {VALUE[:10].encode()!r}, {VALUE[10:].encode()!r}\n"
        "hits = regions = 0\n"
        "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in maps:\n"
        "        span, perms = line.split()[:2]\n"
        "        if not perms.startswith('r'):\n"
        "            continue\n"
        "        start, end = (int(x, 16) for x in span.split('-'))\n"
        "        try:\n"
        "            mem.seek(start)\n"
        "            data = mem.read(end - start)\n"
        "        except (OSError, OverflowError, ValueError):\n"
        "            continue\n"
        "        regions += 1\n"
        "        for at in (m.start() for m in re.finditer(re.escape(first), data)):\n"
        "            hits += data[at + len(first) : at + len(first) + len(second)] == second\n"
        "print(hits, regions > 10)\n"
    )
    assert run(api, sid, dump).strip() == "0 True"


def test_an_unbound_host_gets_the_placeholder_unchanged_and_the_attempt_is_logged(
    server: Server, https: Https, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    url = f"https://{HOSTS[1]}:{https.port}/unbound"
    code = (
        "import os, requests\n"
        "auth = {'Authorization': 'Bearer ' + os.environ['API_KEY']}\n"
        # Inspected: the proxy ends the sandbox's TLS (which trusts the deployment's CA).
        f"r = requests.get('{url}', headers=auth, timeout=60)\n"
        "print(r.status_code, r.text)\n"
    )
    assert run(api, sid, code).strip() == "200 ok"
    received = [auth for host, path, auth in https.seen if path == "/unbound"]
    assert received == ["Bearer cir-secret://API_KEY"]
    events = _secret_events(api, sid)
    assert [(e["details"]["host"], e["details"]["secrets"]) for e in events] == [
        (HOSTS[1], [{"name": "API_KEY", "outcome": "sent unchanged: host not bound"}])
    ]
    # And the service's log line for the connection names the attempt (never a value).
    assert "API_KEY: sent unchanged: host not bound" in server.log.read_text()


def _secret_events(api: httpx.Client, sid: str) -> list[dict[str, Any]]:
    """The session's `secret.used` audit events, once there is one (the proxy records a
    connection as it ends, the audit log takes it a moment later)."""
    events: list[dict[str, Any]] = []
    for _ in range(50):
        page = api.get("/v1/audit", params={"kind": "secret.used", "session_id": sid})
        assert page.status_code == 200, page.text
        events = page.json()["events"]
        if events:
            break
        time.sleep(0.2)
    assert events, "no secret.used event"
    return events


def test_uses_are_audited_by_name_never_by_value(
    server: Server, https: Https, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    url = f"https://{HOSTS[0]}:{https.port}/audited"
    run(
        api,
        sid,
        "import os, requests\n"
        f"requests.get('{url}', headers={{'X-Key': os.environ['API_KEY']}}, timeout=60)\n",
    )
    events = _secret_events(api, sid)
    assert VALUE not in json.dumps(events)
    # One event for the connection, its placeholders' outcomes in it.
    assert len(events) == 1, events
    assert events[0]["details"]["secrets"] == [{"name": "API_KEY", "outcome": "substituted"}]
    assert events[0]["details"]["host"] == HOSTS[0]
    assert events[0]["status"] == "substituted"


def test_a_header_the_secret_is_not_bound_to_gets_the_placeholder_unchanged(
    https: Https, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    url = f"https://{HOSTS[0]}:{https.port}/unlisted-header"
    code = (
        "import os, requests\n"
        "headers = {'X-Echo': os.environ['API_KEY']}\n"
        f"r = requests.get('{url}', headers=headers, timeout=60)\n"
        "print(r.status_code)\n"
    )
    assert run(api, sid, code).strip() == "200"
    received = [echo for _, path, echo in https.seen if path == "/unlisted-header"]
    assert received == ["cir-secret://API_KEY"]


def test_a_paused_session_keeps_names_only_and_is_bound_again_on_resume(
    server: Server, https: Https, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    paused = api.post(f"/v1/sessions/{sid}/pause")
    assert paused.status_code == 200, paused.text
    assert paused.json()["state"] == "paused"
    assert paused.json()["secrets"] == ["API_KEY"]  # its record keeps the names
    for path in server.state_dir.rglob("*"):
        if path.is_file():
            assert VALUE.encode() not in path.read_bytes(), f"{path} holds the value"
    resumed = api.post(f"/v1/sessions/{sid}/resume")
    assert resumed.status_code == 200, resumed.text
    url = f"https://{HOSTS[0]}:{https.port}/resumed"
    code = (
        "import os, requests\n"
        f"r = requests.get('{url}', headers={{'X-Key': os.environ['API_KEY']}}, timeout=60)\n"
        "print(r.status_code, os.environ['API_KEY'])\n"
    )
    assert run(api, sid, code).strip() == "200 cir-secret://API_KEY"
    assert [auth for _, path, auth in https.seen if path == "/resumed"] == [VALUE]
