"""A stand-in for the internet, on the host's loopback: a small web server with a package index.

Tests map made-up names (`allowed.test`...) to it through the egress proxy's test resolver
(the service setting `egress_resolve`), so a sandbox reaches it only through its proxy.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.network.debian_repo import build_deb, flat_repository
from tests.network.npm_registry import build_tarball, registry_documents

PACKAGE = "cirdemo"
PACKAGE_VALUE = "installed through the egress proxy"
PACKAGE_COMMAND = "cirdemo-py"  # its console script, which prints PACKAGE_VALUE
WHEEL = f"{PACKAGE}-1.0-py3-none-any.whl"
HELLO = b"hello from the allowed host"


def build_wheel() -> bytes:
    """A minimal, valid pure-Python wheel, made here so no index outside is needed."""
    files = {
        f"{PACKAGE}/__init__.py": (
            f"VALUE = {PACKAGE_VALUE!r}\n\ndef main() -> None:\n    print(VALUE)\n".encode()
        ),
        f"{PACKAGE}-1.0.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode()
        ),
        f"{PACKAGE}-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{PACKAGE}-1.0.dist-info/entry_points.txt": (
            f"[console_scripts]\n{PACKAGE_COMMAND} = {PACKAGE}:main\n".encode()
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{PACKAGE}-1.0.dist-info/RECORD,,")
    files[f"{PACKAGE}-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


@dataclass
class Upstream:
    port: int
    requests: list[tuple[str, str, str]]  # (method, path, Host header) as received


@contextmanager
def upstream() -> Iterator[Upstream]:
    wheel = build_wheel()
    apt = flat_repository(build_deb())  # `deb [trusted=yes] http://HOST/apt ./`
    tarball = build_tarball()  # `npm --registry http://HOST/npm/`
    seen: list[tuple[str, str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            seen.append(("GET", self.path, self.headers.get("Host", "")))
            if self.path == "/hello":
                self._send(HELLO)
            elif self.path.startswith("/big/"):
                size = int(self.path.rsplit("/", 1)[1])
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    while size > 0:
                        self.wfile.write(chunk[: min(size, len(chunk))])
                        size -= len(chunk)
                except OSError:
                    pass
            elif self.path.rstrip("/") == "/simple":
                self._send(f'<a href="/simple/{PACKAGE}/">{PACKAGE}</a>'.encode(), "text/html")
            elif self.path.rstrip("/") == f"/simple/{PACKAGE}":
                digest = hashlib.sha256(wheel).hexdigest()
                link = f'<a href="/packages/{WHEEL}#sha256={digest}">{WHEEL}</a>'
                self._send(link.encode(), "text/html")
            elif self.path == f"/packages/{WHEEL}":
                self._send(wheel, "application/octet-stream")
            elif self.path.startswith("/apt/") and self.path[5:].removeprefix("./") in apt:
                self._send(apt[self.path[5:].removeprefix("./")], "application/octet-stream")
            elif self.path.startswith("/npm/"):
                npm = registry_documents(f"http://{self.headers.get('Host', '')}/npm", tarball)
                found = npm.get(self.path[5:].replace("%2f", "/").replace("%2F", "/"))
                if found is None:
                    self.send_error(404)
                else:
                    tgz = self.path.endswith(".tgz")
                    self._send(found, "application/octet-stream" if tgz else "application/json")
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            seen.append(("POST", self.path, self.headers.get("Host", "")))
            self._send(b"got " + str(len(body)).encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Upstream(server.server_address[1], seen)
    finally:
        server.shutdown()
        server.server_close()
