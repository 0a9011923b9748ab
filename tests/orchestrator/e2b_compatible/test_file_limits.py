"""The service's file size limits, as E2B's front answers them: the service checks every upload
and download, and the front says it in E2B's shape (413, `{"code", "message"}`, no retry) whether
the file came as an octet-stream, a multipart part, or gzip that inflates past the limit."""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at, stop_cleanly
from tests.orchestrator.service.conftest import Server, make_server

LIMIT = 100_000  # both the upload and the download limit of this module's server


@pytest.fixture(scope="module")
def small_server() -> Iterator[Server]:
    server = make_server(max_upload_bytes=LIMIT, max_download_bytes=LIMIT)
    server.start()
    yield server
    stop_cleanly(server)


@pytest.fixture
def data_plane(
    monkeypatch: pytest.MonkeyPatch, small_server: Server
) -> Iterator[tuple[Sandbox, httpx.Client]]:
    """A sandbox of the default template, and a client of its data plane with its token."""
    point_sdk_at(monkeypatch, small_server.url)
    sandbox = Sandbox.create()
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": sandbox._envd_access_token}
    try:
        with httpx.Client(base_url=small_server.url, headers=headers, timeout=120) as client:
            yield sandbox, client
    finally:
        sandbox.kill()


def assert_too_large(reply: httpx.Response) -> None:
    assert reply.status_code == 413, reply.text
    body = reply.json()
    assert body["code"] == 413 and str(LIMIT) in body["message"], body
    assert reply.headers["Should-Retry"] == "false"  # a smaller file, not waiting, fixes it


def test_an_upload_at_the_limit_is_written_and_one_byte_more_is_refused(
    data_plane: tuple[Sandbox, httpx.Client],
) -> None:
    sandbox, client = data_plane
    at_limit = client.post("/files", params={"path": "full.bin"}, content=b"a" * LIMIT)
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json() == [{"name": "full.bin", "type": "file", "path": "/workspace/full.bin"}]
    assert_too_large(client.post("/files", params={"path": "over.bin"}, content=b"b" * (LIMIT + 1)))
    part = {"file": ("over.bin", io.BytesIO(b"c" * (LIMIT + 1)), "application/octet-stream")}
    assert_too_large(client.post("/files", files=part))
    inflates = gzip.compress(b"d" * (LIMIT + 1))  # small on the wire, over the limit unpacked
    assert len(inflates) < LIMIT
    zipped = client.post(
        "/files",
        params={"path": "over.bin"},
        content=inflates,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"},
    )
    assert_too_large(zipped)
    listing = sandbox.run_code("import os; sorted(os.listdir('.')), os.path.getsize('full.bin')")
    assert listing.text == f"(['full.bin'], {LIMIT})"  # nothing over the limit was written


def test_a_download_over_the_limit_is_refused(data_plane: tuple[Sandbox, httpx.Client]) -> None:
    sandbox, client = data_plane
    made = sandbox.run_code(
        f"open('at.bin', 'wb').write(b'x' * {LIMIT})\n"
        f"open('over.bin', 'wb').write(b'y' * {LIMIT + 1})"
    )
    assert made.error is None, made.error
    at_limit = client.get("/files", params={"path": "/workspace/at.bin"})
    assert at_limit.status_code == 200 and at_limit.content == b"x" * LIMIT
    assert_too_large(client.get("/files", params={"path": "over.bin"}))
    assert sandbox.run_code("'still here'").text == "still here"
