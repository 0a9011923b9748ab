"""Workspace files over HTTP, and the paths that must never reach outside the workspace."""

from __future__ import annotations

import io
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.orchestrator.service.conftest import KEY_A, Server
from tests.security.test_file_abuse import build_deep_tree


def test_upload_list_download_delete(api: httpx.Client, session_id: str) -> None:
    base = f"/v1/sessions/{session_id}/files"
    up = api.post(base, files={"file": ("data.csv", b"a,b\n1,2\n")})
    assert up.status_code == 201, up.text
    assert up.json()["path"] == "data.csv" and up.json()["size"] == 8
    nested = api.post(base, params={"path": "in/deep/x.bin"}, files={"file": ("ignored", b"\0\1")})
    assert nested.json()["path"] == "in/deep/x.bin"
    ex = api.post(
        f"/v1/sessions/{session_id}/execute",
        json={"code": "import pandas as pd; pd.read_csv('data.csv').to_csv('out.csv')"},
    ).json()
    assert ex["status"] == "ok", ex
    listing = api.get(base).json()
    assert sorted(f["path"] for f in listing) == ["data.csv", "in", "out.csv"]
    deep = api.get(base, params={"path": "in", "recursive": True}).json()
    assert [f["path"] for f in deep] == ["in/deep", "in/deep/x.bin"]
    got = api.get(f"{base}/out.csv")
    assert got.status_code == 200 and got.content == b",a,b\n0,1,2\n"
    assert got.headers["content-disposition"] == (
        "attachment; filename=\"out.csv\"; filename*=UTF-8''out.csv"
    )
    assert api.delete(f"{base}/in").status_code == 204
    assert api.get(f"{base}/in/deep/x.bin").status_code == 404


def test_upload_size_limit(api: httpx.Client, session_id: str) -> None:
    r = api.post(f"/v1/sessions/{session_id}/files", files={"file": ("big.bin", b"x" * (6 << 20))})
    assert r.status_code == 413
    assert api.get(f"/v1/sessions/{session_id}/files").json() == []  # nothing written


@pytest.mark.parametrize(
    "path", ["../escape.txt", "a/../../escape.txt", "/etc/evil", "nul\x00byte", "line\nbreak"]
)
def test_bad_upload_paths_are_refused(api: httpx.Client, session_id: str, path: str) -> None:
    r = api.post(
        f"/v1/sessions/{session_id}/files", params={"path": path}, files={"file": ("f", b"x")}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "InvalidPath"


def raw_get(server_url: str, target: str) -> tuple[int, bytes]:
    """Send a request line byte for byte, as an attacker would: no client normalizes it."""
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_A}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    "raw", ["../../../../etc/passwd", "%2e%2e/%2e%2e/etc/passwd", "%2Fetc%2Fpasswd", "a%00b"]
)
def test_bad_download_paths_are_refused(server_url: str, session_id: str, raw: str) -> None:
    status, body = raw_get(server_url, f"/v1/sessions/{session_id}/files/{raw}")
    assert status in (400, 404), body
    assert b"root:" not in body


def test_planted_symlinks_are_refused(api: httpx.Client, session_id: str) -> None:
    with tempfile.TemporaryDirectory(prefix="cir-host-", dir="/tmp") as name:
        check_planted_symlinks(api, session_id, Path(name))


def check_planted_symlinks(api: httpx.Client, session_id: str, host: Path) -> None:
    secret = host / "secret.txt"
    secret.write_text("host only")
    host.chmod(0o755)
    ex = api.post(
        f"/v1/sessions/{session_id}/execute",
        json={
            "code": f"import os; os.symlink({str(secret)!r}, 'link'); "
            f"os.symlink({str(host)!r}, 'dirlink'); os.symlink('/etc/passwd', 'passwd')"
        },
    ).json()
    assert ex["status"] == "ok", ex
    base = f"/v1/sessions/{session_id}/files"
    for path in ("link", "dirlink/secret.txt", "passwd"):
        r = api.get(f"{base}/{path}")
        assert r.status_code == 403, (path, r.text)
        assert b"host only" not in r.content and b"root:" not in r.content
    for path in ("link", "dirlink/new.txt"):
        r = api.post(base, params={"path": path}, files={"file": ("f", b"overwritten")})
        assert r.status_code == 403, (path, r.text)
    assert secret.read_text() == "host only"
    assert sorted(p.name for p in host.iterdir()) == ["secret.txt"]


def test_artifacts_are_served(api: httpx.Client, session_id: str) -> None:
    r = api.post(
        "/v1/tools/code_interpreter/invoke",
        json={
            "arguments": {
                "code": "import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()",
                "session_id": session_id,
            },
            "format": "openai_responses",
            "call_id": "call-art",
            "inline_images": False,
        },
    ).json()
    parts = r["output"]["output"]
    url = next(p["image_url"] for p in parts if p["type"] == "input_image")
    assert url.startswith("http://127.0.0.1:") and "/artifacts/" in url
    png = api.get(url)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(png.content)).format == "PNG"
    assert api.get(url.rsplit("/", 1)[0] + "/nonexistent").status_code == 404


def test_unicode_names_download(api: httpx.Client, session_id: str) -> None:
    name = "数据 résumé.csv"
    up = api.post(
        f"/v1/sessions/{session_id}/files", params={"path": name}, files={"file": ("x", b"1")}
    )
    assert up.status_code == 201 and up.json()["path"] == name
    got = api.get(f"/v1/sessions/{session_id}/files/{name}")
    assert got.status_code == 200 and got.content == b"1"
    assert (
        "filename*=UTF-8''%E6%95%B0%E6%8D%AE%20r%C3%A9sum%C3%A9.csv"
        in got.headers["content-disposition"]
    )


def test_a_name_that_is_not_utf8_is_listed_escaped(api: httpx.Client, session_id: str) -> None:
    ex = api.post(
        f"/v1/sessions/{session_id}/execute",
        json={"code": "open(b'caf\\xe9.txt', 'w').write('x'); open('ok.txt', 'w').write('y')"},
    ).json()
    assert ex["status"] == "ok", ex
    for recursive in (False, True):
        r = api.get(f"/v1/sessions/{session_id}/files", params={"recursive": recursive})
        assert r.status_code == 200, r.text
        listed = {f["path"]: f["name_escaped"] for f in r.json()}
        assert listed == {"caf\\xe9.txt": True, "ok.txt": False}


def test_a_tree_3000_deep_is_removed_by_delete_and_by_closing(
    server: Server, api: httpx.Client, session_id: str
) -> None:
    code = build_deep_tree("first") + build_deep_tree("second")
    ex = api.post(f"/v1/sessions/{session_id}/execute", json={"code": code}).json()
    assert ex["status"] == "ok", ex
    r = api.delete(f"/v1/sessions/{session_id}/files/first")
    assert r.status_code == 204, r.text
    assert [f["path"] for f in api.get(f"/v1/sessions/{session_id}/files").json()] == ["second"]
    (own,) = [d for d in session_directories(server) if (d / "workspace" / "second").is_dir()]
    assert api.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert not own.exists(), "the session's directory was left behind"


def session_directories(server: Server) -> list[Path]:
    found: list[Path] = []
    for backend in ("local", "docker"):
        if (server.state_dir / backend).is_dir():
            found += (server.state_dir / backend).iterdir()
    return found
