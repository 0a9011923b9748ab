"""Sessions with a network policy, end to end: a real server, real sandboxes on each backend, a
real web server and package index on the host's loopback standing in for the internet. Names
reach it only through the egress proxy's test resolver (`egress_resolve`); nothing here dials
an outside address."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from tests.network.conftest import FETCH, MAX_BYTES, Net
from tests.network.npm_registry import NPM_PACKAGE, NPM_SAYS
from tests.network.upstream import HELLO, PACKAGE, PACKAGE_COMMAND, PACKAGE_VALUE
from tests.orchestrator.service.conftest import make_server, service_backends


@pytest.fixture(params=service_backends())
def session(request: pytest.FixtureRequest, net: Net) -> Iterator[tuple[httpx.Client, str]]:
    port = net.up.port
    policy = {"allow": [f"allowed.test:{port}", f"rebind.test:{port}", "metadata.test:80"]}
    with net.server.client() as api:
        created = api.post("/v1/sessions", json={"backend": request.param, "network": policy})
        assert created.status_code == 201, created.text
        assert created.json()["network"]["mode"] == "allow_list"
        sid = created.json()["id"]
        ran = run(api, sid, FETCH)
        assert ran == "", ran
        yield api, sid
        api.delete(f"/v1/sessions/{sid}")


def run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["error"] is None, body["error"]
    return str(body["stdout"])


def fetched(api: httpx.Client, sid: str, url: str, proxy: bool = True) -> tuple[int, str]:
    status, text = json.loads(run(api, sid, f"print(json.dumps(fetch({url!r}, {proxy})))"))
    return int(status), str(text)


def test_an_allowed_host_is_reached_by_urllib_requests_and_curl(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    assert fetched(api, sid, f"{net.allowed}/hello") == (200, HELLO.decode())
    got = run(api, sid, f"import requests; print(requests.get('{net.allowed}/hello').text)")
    assert got.strip() == HELLO.decode()
    for how in ([], ["-p"]):  # a plain proxied GET, then through a CONNECT tunnel
        result = api.post(
            f"/v1/sessions/{sid}/commands",
            json={"argv": ["curl", "-sS", *how, f"{net.allowed}/hello"]},
        ).json()
        assert (result["exit_code"], result["stdout"]) == (0, HELLO.decode()), result
    assert ("GET", "/hello", f"allowed.test:{net.up.port}") in net.up.requests


def test_pip_installs_from_an_allowed_index_and_the_kernel_imports_it(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    code = (
        "import subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--index-url', "
        f"'{net.allowed}/simple', '--trusted-host', 'allowed.test', '{PACKAGE}'], "
        "capture_output=True, text=True)\n"
        "print(r.returncode, r.stdout[-2000:], r.stderr[-2000:])\n"
    )
    out = run(api, sid, code)
    assert out.startswith("0 "), out
    assert run(api, sid, f"import {PACKAGE}; print({PACKAGE}.VALUE)").strip() == PACKAGE_VALUE
    # Its console script runs by name (pip's target's bin is on PATH).
    ran = api.post(f"/v1/sessions/{sid}/commands", json={"command": PACKAGE_COMMAND}).json()
    assert (ran["exit_code"], ran["stdout"]) == (0, PACKAGE_VALUE + "\n"), ran
    # In the workspace: a restarted kernel still has it.
    assert api.post(f"/v1/sessions/{sid}/restart").status_code == 200
    assert run(api, sid, f"import {PACKAGE}; print({PACKAGE}.VALUE)").strip() == PACKAGE_VALUE


def test_npm_installs_from_an_allowed_registry_without_root(net: Net) -> None:
    """`npm i -g` as agents write it works as the sandbox's unprivileged user: its prefix is the
    workspace's (/home/user/.local), its command on PATH, kept across a kernel restart; a plain
    `npm install` too. The image's npm; the registry one the policy allows, through the proxy."""
    if "docker" not in service_backends():
        pytest.skip("npm is the kernel image's: the docker backend is not selected")
    registry_url = f"{net.allowed}/npm/"
    with net.server.client() as api:
        policy = {"allow": [f"allowed.test:{net.up.port}"]}
        created = api.post("/v1/sessions", json={"backend": "docker", "network": policy})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:

            def command(line: str) -> dict[str, object]:
                done = api.post(
                    f"/v1/sessions/{sid}/commands", json={"command": line, "timeout_s": 120}
                )
                assert done.status_code == 200, done.text
                result: dict[str, object] = done.json()
                return result

            install = f"npm i -g --registry {registry_url} {NPM_PACKAGE}"
            installed = command(f"{install} && {NPM_PACKAGE}")
            assert installed["exit_code"] == 0, installed
            assert str(installed["stdout"]).endswith(NPM_SAYS + "\n"), installed
            where = command(f"command -v {NPM_PACKAGE}")
            assert where["stdout"] == f"/home/user/.local/bin/{NPM_PACKAGE}\n", where
            assert api.post(f"/v1/sessions/{sid}/restart").status_code == 200
            again = run(
                api, sid, f"import subprocess; print(subprocess.getoutput('{NPM_PACKAGE}'))"
            )
            assert again.strip() == NPM_SAYS
            local = command(
                f"mkdir -p app && cd app && npm install --registry {registry_url} {NPM_PACKAGE} && "
                f"node -p \"require.resolve('{NPM_PACKAGE}')\""
            )
            assert local["exit_code"] == 0, local
            assert f"app/node_modules/{NPM_PACKAGE}/cli.js" in str(local["stdout"]), local
        finally:
            api.delete(f"/v1/sessions/{sid}")
    assert ("GET", f"/npm/{NPM_PACKAGE}", f"allowed.test:{net.up.port}") in net.up.requests


def test_a_host_outside_the_policy_gets_a_403_that_says_why(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    status, text = fetched(api, sid, f"http://other.test:{net.up.port}/hello")
    assert status == 403 and "allow-list" in text and "allowed.test" in text, text
    # Through a tunnel (as for HTTPS) the client shows the status line: the reason is there too.
    status, text = fetched(api, sid, "https://other.test/hello")
    assert status == 0 and "403" in text and "allow-list" in text, text
    # An allowed host on a port it is not allowed.
    status, text = fetched(api, sid, "http://allowed.test:22/")
    assert status == 403 and "allow-list" in text, text
    assert not any(path == "/hello" and "other.test" in host for _, path, host in net.up.requests)


@pytest.mark.parametrize(
    "url",
    [
        "http://rebind.test:{port}/hello",  # allowed by name, resolves to loopback
        "http://metadata.test/latest/meta-data/",  # allowed by name, resolves to link-local
        "http://127.0.0.1:{port}/hello",
        "http://[::1]:{port}/hello",
        "http://[::ffff:127.0.0.1]:{port}/hello",
        "http://2130706433:{port}/hello",
        "http://0x7f.1:{port}/hello",
        "http://localhost:{port}/hello",
        "http://169.254.169.254/latest/meta-data/",
    ],
)
def test_private_destinations_are_refused_however_they_are_spelled(
    net: Net, session: tuple[httpx.Client, str], url: str
) -> None:
    api, sid = session
    before = len(net.up.requests)
    status, text = fetched(api, sid, url.format(port=net.up.port))
    assert status in (400, 403), (status, text)
    assert len(net.up.requests) == before, "the upstream was reached"


def test_only_the_proxy_leads_out(net: Net, session: tuple[httpx.Client, str]) -> None:
    api, sid = session
    # Without the proxy: the host's loopback is not the sandbox's, and there is no other route.
    status, text = fetched(api, sid, f"http://127.0.0.1:{net.up.port}/hello", proxy=False)
    assert status == 0 and ("refused" in text.lower() or "unreachable" in text.lower()), text
    server_port = net.server.url.rsplit(":", 1)[1]
    status, text = fetched(api, sid, f"http://127.0.0.1:{server_port}/healthz", proxy=False)
    assert status == 0, text
    status, text = fetched(api, sid, f"http://allowed.test:{net.up.port}/hello", proxy=False)
    assert status == 0, text  # no name service either
    # The service itself is not reachable through the proxy.
    status, _ = fetched(api, sid, f"http://127.0.0.1:{server_port}/healthz")
    assert status in (400, 403)
    # The egress directory holds this session's socket and the public files a session with
    # secrets trusts (the system's CAs and the deployment's: never a key), read-only.
    listed = run(
        api,
        sid,
        "import os, pathlib\nprint(sorted(os.listdir('/run/egress')))\n"
        "print(any(b'PRIVATE KEY' in p.read_bytes() for p in pathlib.Path('/run/egress')"
        ".glob('*.pem')))\n"
        "try:\n    open('/run/egress/x', 'w')\nexcept OSError as e:\n    print(type(e).__name__)",
    )
    names, private, refused = listed.splitlines()
    assert names == "['ca-bundle.pem', 'egress-ca.pem', 'proxy.sock']", listed
    assert private == "False" and refused in ("OSError", "PermissionError"), listed


def test_another_sessions_socket_is_out_of_reach(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    other = api.post("/v1/sessions", json={"network": "any"})
    assert other.status_code == 201, other.text
    try:
        backend = other.json()["backend"]
        theirs = net.server.state_dir / backend / other.json()["id"] / "egress" / "proxy.sock"
        code = (
            "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({str(theirs)!r}); print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)"
        )
        assert run(api, sid, code).strip() == "FileNotFoundError"
    finally:
        api.delete(f"/v1/sessions/{other.json()['id']}")


def test_a_host_header_that_disagrees_with_the_target_is_refused(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    port = net.up.port
    before = len(net.up.requests)
    code = (
        "import socket\ns = socket.create_connection(('127.0.0.1', 3128))\n"
        f"s.sendall(b'GET http://allowed.test:{port}/hello HTTP/1.1\\r\\n"
        f"Host: other.test:{port}\\r\\nConnection: close\\r\\n\\r\\n')\n"
        "print(s.recv(200).split(b'\\r\\n')[0].decode())"
    )
    status_line = run(api, sid, code).strip()
    assert status_line.split()[1] in ("400", "403"), status_line
    assert len(net.up.requests) == before


def test_every_connection_is_logged_and_counted(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    fetched(api, sid, f"{net.allowed}/hello")
    fetched(api, sid, f"http://other.test:{net.up.port}/hello")
    report = api.get(f"/v1/sessions/{sid}/network").json()
    assert report["policy"]["mode"] == "allow_list" and report["ceiling"]["mode"] == "any"
    allowed = [c for c in report["connections"] if c["allowed"]]
    refused = [c for c in report["connections"] if not c["allowed"]]
    assert allowed and allowed[-1]["host"] == "allowed.test"
    assert allowed[-1]["bytes_down"] >= len(HELLO) and allowed[-1]["address"] == "127.0.0.1"
    assert refused and refused[-1]["host"] == "other.test" and "allow-list" in refused[-1]["reason"]
    assert report["connections_allowed"] >= 1 and report["connections_refused"] >= 1
    metrics = api.get("/metrics").text
    assert 'cir_egress_connections_total{backend="' in metrics
    assert 'decision="refused"' in metrics and "cir_egress_bytes_total" in metrics


def test_a_sessions_bytes_are_capped(net: Net, session: tuple[httpx.Client, str]) -> None:
    api, sid = session
    status, text = fetched(api, sid, f"{net.allowed}/big/{3 * MAX_BYTES}")
    assert status != 200 or len(text) < 3 * MAX_BYTES, "the cap let the whole body through"
    status, text = fetched(api, sid, f"{net.allowed}/hello")
    assert status == 403 and "cap" in text.lower(), (status, text)
    report = api.get(f"/v1/sessions/{sid}/network").json()
    assert report["bytes_up"] + report["bytes_down"] <= MAX_BYTES + (256 << 10)


def test_a_session_without_a_policy_has_no_network(net: Net) -> None:
    with net.server.client() as api:
        for backend in service_backends():
            created = api.post("/v1/sessions", json={"backend": backend}).json()
            sid = created["id"]
            try:
                assert created["network"]["mode"] == "none"
                code = (
                    "import os; print(os.environ.get('HTTP_PROXY'), os.path.exists('/run/egress'))"
                )
                assert run(api, sid, code).strip() == "None False"
                run(api, sid, FETCH)
                status, _ = fetched(api, sid, f"http://allowed.test:{net.up.port}/hello")
                assert status == 0
                report = api.get(f"/v1/sessions/{sid}/network").json()
                assert report["connections"] == [] and report["policy"]["mode"] == "none"
            finally:
                api.delete(f"/v1/sessions/{sid}")


def test_a_policy_above_the_ceiling_is_refused() -> None:
    server = make_server(network_ceiling="allowed.test:80,*.example.org")
    server.start()
    try:
        with server.client() as api:
            for asked in ("any", ["other.test"], ["allowed.test:22"], ["*.org"]):
                reply = api.post("/v1/sessions", json={"network": asked})
                assert reply.status_code == 400, reply.text
                assert "beyond this deployment" in reply.text and "allowed.test" in reply.text
            bad = api.post("/v1/sessions", json={"network": ["exa*mple.org"]})
            assert bad.status_code in (400, 422) and "wildcard" in bad.text
            fits = api.post("/v1/sessions", json={"network": ["files.example.org:443"]})
            assert fits.status_code == 201, fits.text
            api.delete(f"/v1/sessions/{fits.json()['id']}")
    finally:
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def test_a_client_that_half_closes_still_gets_every_answer(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    """A client that sends its request and then shuts its sending side (as some do) leaves the
    forwarder's connection with no reader registered on either side: it must still deliver
    the answer, every time (its tasks are held, not left to the garbage collector)."""
    api, sid = session
    code = (
        "import socket\nempty = 0\n"
        "for _ in range(150):\n"
        "    s = socket.create_connection(('127.0.0.1', 3128))\n"
        f"    s.sendall(b'GET http://other.test:{net.up.port}/ HTTP/1.1\\r\\n"
        f"Host: other.test:{net.up.port}\\r\\n\\r\\n')\n"
        "    s.shutdown(socket.SHUT_WR)\n"
        "    data = b''\n"
        "    while chunk := s.recv(65536):\n"
        "        data += chunk\n"
        "    s.close()\n"
        "    empty += not data.startswith(b'HTTP/1.1 403')\n"
        "print(empty)"
    )
    assert run(api, sid, code).strip() == "0"
