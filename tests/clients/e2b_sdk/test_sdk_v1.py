"""E2B's v1 SDK, and E2B's own MCP server (which pins it), in their documented setup: a domain
whose API is `api.<domain>` and whose sandboxes are `<port>-<id>.<domain>`, over HTTPS. Here the
domain is `e2b.test`, resolved to loopback inside the SDK's process alone, behind a TLS front
with a test CA (what an operator's wildcard DNS record and TLS proxy are); the SDK sends no
E2b-Sandbox-Id, so the service reads the sandbox from the host, and its code interpreter sends
no token, so the server honours E2B's `secure: false` (e2b_honor_insecure). They run from the
venv `make install` makes for them (.venv-e2b-v1), unmodified."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import ssl
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.e2b_sdk_fixtures import e2b_server, stop_cleanly
from tests.orchestrator.service.conftest import KEY_A, Server, make_server

__all__ = ["e2b_server"]  # the fixture, used here by name

ROOT = Path(__file__).resolve().parents[3]
V1_PYTHON = ROOT / ".venv-e2b-v1/bin/python"
DOMAIN = "e2b.test"
# In the SDK's process only: the domain's names are loopback (an operator's wildcard record).
RESOLVER = textwrap.dedent(
    """
    import socket
    _resolve = socket.getaddrinfo
    def _loopback(host, *args, **kwargs):
        if isinstance(host, str) and (host == "e2b.test" or host.endswith(".e2b.test")):
            host = "127.0.0.1"
        return _resolve(host, *args, **kwargs)
    socket.getaddrinfo = _loopback
    """
)
V1_SCRIPT = textwrap.dedent(
    """
    import json
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox()
    try:
        said = {"text": sbx.run_code("6 * 7").text,
                "stdout": sbx.commands.run("echo hi").stdout,
                "host": sbx.get_host(8000)}
        sbx.files.write("/home/user/v1.txt", "from v1")
        said["file"] = sbx.files.read("/home/user/v1.txt")
        said["id"] = sbx.sandbox_id
    finally:
        sbx.kill()
    print(json.dumps(said))
    """
)


def _certificates(where: Path) -> tuple[Path, Path, Path]:
    """A test CA, and a certificate it signed for the domain and its subdomains."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, DOMAIN)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(DOMAIN), x509.DNSName(f"*.{DOMAIN}")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = where / "ca.pem", where / "cert.pem", where / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_file, cert_file, key_file


class TlsFront:
    """What an operator puts before the service: TLS for the domain, the bytes passed on."""

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        )
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@contextlib.contextmanager
def domain_for(server: Server, where: Path) -> Iterator[dict[str, str]]:
    """The environment E2B's v1 SDK runs with against `server` behind a TLS front for the
    domain: E2B_DOMAIN, the key, the CA it trusts, the resolver of its process."""
    assert V1_PYTHON.exists(), "make install makes .venv-e2b-v1 (E2B's v1 SDK)"
    ca, cert, key = _certificates(where)
    (where / "sitecustomize.py").write_text(RESOLVER)
    front = TlsFront(int(server.url.rsplit(":", 1)[1]), cert, key)
    try:
        yield {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(where),
            "E2B_DOMAIN": f"{DOMAIN}:{front.port}",
            "E2B_API_KEY": KEY_A,
            "SSL_CERT_FILE": str(ca),
            "PYTHONPATH": str(where),
        }
    finally:
        front.stop()


@pytest.fixture(scope="module")
def v1_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A server that honours E2B's `secure: false`, as the v1 SDK needs."""
    server = make_server(e2b_honor_insecure="true")
    server.start()
    try:
        with domain_for(server, tmp_path_factory.mktemp("e2b-v1")) as env:
            yield env
    finally:
        stop_cleanly(server)


def run_v1(env: dict[str, str], script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(V1_PYTHON), "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_v1_sdk_runs_code_commands_and_files_by_domain(v1_env: dict[str, str]) -> None:
    done = run_v1(v1_env, V1_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["text"] == "42" and said["stdout"] == "hi\n" and said["file"] == "from v1"
    assert said["host"] == f"8000-{said['id']}.{v1_env['E2B_DOMAIN']}"


def test_where_insecure_sandboxes_are_not_honoured_v1_code_is_refused(
    e2b_server: Server, tmp_path: Path
) -> None:
    """The service's default: every sandbox wants its token, so the v1 code interpreter (which
    sends none) is refused, as for a sandbox that is gone; envd's calls, with the token, work."""
    script = (
        "from e2b_code_interpreter import Sandbox\n"
        "sbx = Sandbox()\n"
        "try:\n"
        "    print(sbx.commands.run('echo hi').stdout.strip())\n"
        "    sbx.run_code('1')\n"
        "finally:\n"
        "    sbx.kill()\n"
    )
    with domain_for(e2b_server, tmp_path) as env:
        done = run_v1(env, script)
    assert done.returncode != 0 and done.stdout.strip() == "hi", done.stdout
    assert "was not found" in done.stderr, done.stderr[-2000:]


async def test_e2b_mcp_server_runs_code(v1_env: dict[str, str]) -> None:
    """E2B's own MCP server (its `run_code` tool), driven by an MCP client over stdio."""
    server = StdioServerParameters(
        command=str(V1_PYTHON),
        args=["-c", "import e2b_mcp_server; e2b_mcp_server.main()"],
        env=v1_env,
    )
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        assert [tool.name for tool in tools.tools] == ["run_code"]
        result = await asyncio.wait_for(
            session.call_tool("run_code", {"code": "print(6 * 7)"}), 300
        )
    assert not result.is_error, result
    said = json.loads(result.content[0].text)  # type: ignore[union-attr]
    assert said["stdout"] == ["42\n"], said
