"""Real clients through the proxy: curl (plain and CONNECT), requests (http and https through
CONNECT, TLS untouched) and urllib reach the allowed name and read the 403 for a refused one."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
import requests

from tests.sandbox.egress.conftest import (
    HELLO,
    Running,
    StartProxy,
    UpstreamServer,
    curl,
    overrides,
)


@pytest.fixture
async def running(start_proxy: StartProxy, upstream: UpstreamServer) -> Running:
    return await start_proxy(
        {"allow": [{"host": "allowed.test", "ports": [upstream.port, upstream.tls_port]}]},
        resolve_overrides=overrides("allowed.test", "refused.test"),
        private_hosts=frozenset(
            {f"allowed.test:{upstream.port}", f"allowed.test:{upstream.tls_port}", "refused.test"}
        ),
    )


async def test_curl_plain_http_reaches_an_allowed_name(
    running: Running, upstream: UpstreamServer
) -> None:
    code, out, err = await curl("-x", running.url, f"http://allowed.test:{upstream.port}/hello")
    assert code == 0, err
    assert out.encode() == HELLO
    (record,) = await running.records(1)
    assert (record.host, record.port, record.method) == ("allowed.test", upstream.port, "GET")
    assert record.allowed and record.address == "127.0.0.1"
    assert record.bytes_up > 0 and record.bytes_down > len(HELLO)
    assert running.ledger.totals.connections_allowed == 1
    assert running.ledger.bytes_used == record.bytes_up + record.bytes_down


async def test_curl_connect_tunnel_reaches_an_allowed_name(
    running: Running, upstream: UpstreamServer
) -> None:
    code, out, err = await curl(
        "-p", "-x", running.url, f"http://allowed.test:{upstream.port}/hello"
    )
    assert code == 0, err
    assert out.encode() == HELLO
    (record,) = await running.records(1)
    assert record.method == "CONNECT" and record.allowed


async def test_curl_https_through_connect_keeps_tls_end_to_end(
    running: Running, upstream: UpstreamServer
) -> None:
    """The certificate curl checks is the upstream's own: the proxy never touches TLS."""
    code, out, err = await curl(
        "--cacert", upstream.ca_file, "-x", running.url,
        f"https://allowed.test:{upstream.tls_port}/hello",
    )  # fmt: skip
    assert code == 0, err
    assert out.encode() == HELLO


async def test_curl_reads_the_refusal_for_a_refused_name(
    running: Running, upstream: UpstreamServer
) -> None:
    code, out, err = await curl("-i", "-x", running.url, f"http://refused.test:{upstream.port}/")
    assert code == 0, err
    status, _, _ = out.partition("\r\n")
    assert status.startswith("HTTP/1.1 403 egress refused: refused.test:")
    assert f"refused.test:{upstream.port} is not in the allow-list (allowed.test:" in out
    assert "ask the operator to allow it" in out
    (record,) = await running.records(1)
    assert not record.allowed and record.address is None
    assert record.bytes_up == record.bytes_down == 0
    assert running.ledger.totals.connections_refused == 1


async def test_curl_connect_to_a_refused_name_fails_with_403(
    running: Running, upstream: UpstreamServer
) -> None:
    code, _, err = await curl("-p", "-x", running.url, f"http://refused.test:{upstream.port}/")
    assert code != 0
    assert "403" in err


def _session(proxy_url: str) -> requests.Session:
    session = requests.Session()
    session.trust_env = False
    session.proxies = {"http": proxy_url, "https": proxy_url}
    return session


async def test_requests_reaches_the_allowed_name_over_http_and_https(
    running: Running, upstream: UpstreamServer
) -> None:
    def fetch() -> tuple[requests.Response, requests.Response]:
        with _session(running.url) as s:
            plain = s.get(f"http://allowed.test:{upstream.port}/hello", timeout=30)
            tls = s.get(
                f"https://allowed.test:{upstream.tls_port}/hello",
                timeout=30,
                verify=upstream.ca_file,
                headers={"Connection": "close"},  # so the tunnel ends and leaves its record
            )
            return plain, tls

    plain, tls = await asyncio.to_thread(fetch)
    assert plain.status_code == 200 and plain.content == HELLO
    assert tls.status_code == 200 and tls.content == HELLO
    records = await running.records(2)
    assert sorted(r.method for r in records) == ["CONNECT", "GET"]


async def test_requests_shows_the_reason_of_a_refused_connect(
    running: Running, upstream: UpstreamServer
) -> None:
    """requests (like pip) shows only the status line of a refused CONNECT: it carries why."""

    def fetch() -> str:
        with _session(running.url) as s, pytest.raises(requests.exceptions.ProxyError) as caught:
            s.get(f"https://refused.test:{upstream.tls_port}/", timeout=30)
        return str(caught.value)

    message = await asyncio.to_thread(fetch)
    assert "403" in message
    assert "is not in the allow-list" in message


async def test_requests_posts_a_body_and_reads_the_echo(
    running: Running, upstream: UpstreamServer
) -> None:
    def post() -> tuple[requests.Response, requests.Response]:
        with _session(running.url) as s:
            sized = s.post(f"http://allowed.test:{upstream.port}/echo", data=b"a" * 200_000)
            chunked = s.post(
                f"http://allowed.test:{upstream.port}/echo",
                data=iter([b"part1-", b"part2-", b"part3"]),  # a generator: chunked
            )
            return sized, chunked

    sized, chunked = await asyncio.to_thread(post)
    assert sized.content == b"echo:" + b"a" * 200_000
    assert chunked.content == b"echo:part1-part2-part3"


async def test_urllib_reaches_the_allowed_name_and_reads_the_refusal(
    running: Running, upstream: UpstreamServer
) -> None:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": running.url, "https": running.url})
    )

    def fetch() -> tuple[bytes, int, str]:
        with opener.open(f"http://allowed.test:{upstream.port}/hello", timeout=30) as ok:
            body = ok.read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(f"http://refused.test:{upstream.port}/", timeout=30)
        return body, refused.value.code, refused.value.read().decode()

    body, status, text = await asyncio.to_thread(fetch)
    assert body == HELLO
    assert status == 403
    assert text.startswith(f"egress refused: refused.test:{upstream.port} is not in the allow-list")


async def test_urllib_https_refusal_carries_the_reason(
    running: Running, upstream: UpstreamServer
) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"https": running.url}))

    def fetch() -> str:
        with pytest.raises(urllib.error.URLError) as refused:
            opener.open(f"https://refused.test:{upstream.tls_port}/", timeout=30)
        return str(refused.value)

    message = await asyncio.to_thread(fetch)
    assert "403" in message and "is not in the allow-list" in message


async def test_forwarded_request_is_origin_form_with_connection_close(
    running: Running, upstream: UpstreamServer
) -> None:
    """What the destination sees: its own path, its own Host, no proxy credentials."""
    code, out, err = await curl(
        "-i", "-x", running.url, "-H", "Proxy-Authorization: Basic c2VjcmV0",
        f"http://allowed.test:{upstream.port}/p?q=1",
    )  # fmt: skip
    assert code == 0, err
    headers = out.lower()
    assert "x-seen-path: /p?q=1\r\n" in headers
    assert f"x-seen-host: allowed.test:{upstream.port}\r\n" in headers
    assert "x-seen-connection: close\r\n" in headers
    assert "x-seen-proxy-authorization: \r\n" in headers
    assert "connection: close\r\n" in headers


async def test_head_request_gets_headers_and_no_body(
    running: Running, upstream: UpstreamServer
) -> None:
    code, out, err = await curl("-I", "-x", running.url, f"http://allowed.test:{upstream.port}/")
    assert code == 0, err
    assert out.startswith("HTTP/1.1 200")
    assert out.endswith("\r\n\r\n")


async def test_curl_uploads_a_large_body_with_expect_100_continue(
    running: Running, upstream: UpstreamServer
) -> None:
    """curl asks `Expect: 100-continue` for large bodies; the proxy answers it itself."""
    process = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "60", "--expect100-timeout", "30", "-x", running.url,
        "--data-binary", "@-", f"http://allowed.test:{upstream.port}/echo",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    body = b"b" * (3 << 20)
    out, err = await process.communicate(body)
    assert process.returncode == 0, err
    assert out == b"echo:" + body
    (record,) = await running.records(1)
    assert record.bytes_up > len(body) and record.bytes_down > len(body)
