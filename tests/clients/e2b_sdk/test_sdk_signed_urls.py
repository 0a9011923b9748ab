"""E2B's signed file URLs, made by its unmodified SDK (`upload_url`, `download_url`) and used
by a client that sends no header at all, as a browser or `curl` given the link would."""

from __future__ import annotations

import time
import urllib.parse

import httpx
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import Server


def _with_query(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update(changes)
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def test_a_signed_url_uploads_and_downloads_its_path_with_no_header(sbx: Sandbox) -> None:
    upload = sbx.upload_url("/home/user/shared/report.csv")
    assert "signature=v1_" in upload
    sent = httpx.post(upload, files={"file": ("report.csv", b"a,b\n1,2\n")})
    assert sent.status_code == 200, sent.text
    assert sbx.files.read("shared/report.csv") == "a,b\n1,2\n"

    got = httpx.get(sbx.download_url("/home/user/shared/report.csv"))
    assert got.status_code == 200 and got.content == b"a,b\n1,2\n", got.text
    # Under the front's /e2b prefix too, and whatever E2B-looking host a proxy in front gives.
    via_prefix = httpx.get(sbx.download_url("shared/report.csv").replace("/files?", "/e2b/files?"))
    assert via_prefix.status_code == 200 and via_prefix.content == b"a,b\n1,2\n", via_prefix.text
    proxied = httpx.get(
        sbx.download_url("shared/report.csv"), headers={"Host": "8000-workspace.example.io"}
    )
    assert proxied.status_code == 200, proxied.text
    # Outside the workspace too (the sandbox's own /tmp), and as raw bytes.
    sbx.files.write("/tmp/blob.bin", bytes(range(256)))
    assert httpx.get(sbx.download_url("/tmp/blob.bin")).content == bytes(range(256))
    octets = httpx.post(
        sbx.upload_url("/tmp/raw.bin"),
        content=b"\x00\x01",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert octets.status_code == 200, octets.text
    assert sbx.files.read("/tmp/raw.bin", format="bytes") == b"\x00\x01"


def test_a_signed_url_opens_only_its_path_and_operation(sbx: Sandbox) -> None:
    sbx.files.write("secret.txt", "s")
    sbx.files.write("open.txt", "o")
    read = sbx.download_url("open.txt")
    assert httpx.get(read).text == "o"
    # Another path under the same signature, or the read URL used to write: no sandbox.
    for refused in (
        httpx.get(_with_query(read, path="secret.txt")),
        httpx.post(read, files={"file": ("open.txt", b"overwritten")}),
        httpx.get(sbx.upload_url("open.txt")),  # a write link does not read
        httpx.get(_with_query(read, username="root")),
        httpx.get(_with_query(read, signature="v1_" + "A" * 43)),
    ):
        assert refused.status_code == 401, refused.text
        assert refused.json()["code"] == 401
        assert "signature" in refused.json()["message"]
    assert sbx.files.read("open.txt") == "o"
    # One signed upload writes its one path, not the names of several parts.
    several = httpx.post(
        sbx.upload_url("one.txt"), files=[("file", ("a.txt", b"a")), ("file", ("b.txt", b"b"))]
    )
    assert several.status_code == 400 and "one" in several.json()["message"], several.text
    assert not sbx.files.exists("a.txt") and not sbx.files.exists("b.txt")
    # Without a signature or a token, nothing is opened.
    bare = httpx.get(read.split("?")[0], params={"path": "open.txt"})
    assert bare.status_code == 401, bare.text


def test_a_signed_url_with_an_expiration_works_until_then(sbx: Sandbox) -> None:
    sbx.files.write("soon.txt", "x")
    lasting = sbx.download_url("soon.txt", use_signature_expiration=120)
    assert "signature_expiration=" in lasting
    assert httpx.get(lasting).text == "x"
    # Its expiration is signed: moved later, the signature no longer matches.
    later = str(int(time.time()) + 3600)
    assert httpx.get(_with_query(lasting, signature_expiration=later)).status_code == 401
    expired = httpx.get(sbx.download_url("soon.txt", use_signature_expiration=-5))
    assert expired.status_code == 401 and "expired" in expired.json()["message"], expired.text
    for malformed in (
        httpx.get(_with_query(lasting, signature_expiration="soon")),
        httpx.get(_with_query(lasting, signature_expiration="\u00b2")),  # a digit, not ASCII
        # A user with a colon could make `path:op:user` read as another path's: refused.
        httpx.get(_with_query(lasting, username="a:b")),
        # A path is short enough to hash cheaply for each sandbox tried.
        httpx.get(_with_query(lasting, path="x" * 5000)),
    ):
        assert malformed.status_code == 400, malformed.text


def test_a_signed_url_of_another_sandbox_or_a_killed_one_opens_nothing(
    e2b_env: Server, template: str
) -> None:
    first = Sandbox.create(template=template)
    second = Sandbox.create(template=template)
    try:
        first.files.write("mine.txt", "first's")
        second.files.write("mine.txt", "second's")
        assert httpx.get(first.download_url("mine.txt")).text == "first's"
        assert httpx.get(second.download_url("mine.txt")).text == "second's"
        # Named in E2B's header, a sandbox is opened only by a URL its own token signed.
        crossed = httpx.get(
            first.download_url("mine.txt"), headers={"E2b-Sandbox-Id": second.sandbox_id}
        )
        assert crossed.status_code == 401, crossed.text
        kept = first.download_url("mine.txt")
    finally:
        second.kill()
        first.kill()
    assert httpx.get(kept).status_code == 401
