"""Volumes over HTTP (docs/volumes.md): made and owned by a key, files reached from outside,
mounted into sessions of every backend that mounts (read-write or read-only, several at once),
held while mounted, and held to their size."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

from code_interpreter_client.http_client import APIError, Client
from tests.orchestrator.governance.conftest import add_key_to, eventually, run_keys
from tests.orchestrator.service.conftest import (
    KEY_A,
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(
        volume_default_size_mb=16,
        volume_max_size_mb=64,
        max_volume_bytes_per_key=100 << 20,
        max_volumes_per_key=4,
        max_upload_bytes=40 << 20,
    ).start()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture
def volume(api: httpx.Client) -> Iterator[str]:
    made = api.post("/v1/volumes", json={"name": "dataset"})
    assert made.status_code == 201, made.text
    yield made.json()["id"]
    api.delete(f"/v1/volumes/{made.json()['id']}")


def session(api: httpx.Client, backend: str, *mounts: dict[str, object]) -> str:
    made = api.post("/v1/sessions", json={"backend": backend, "volumes": list(mounts)})
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def run(api: httpx.Client, session_id: str, code: str) -> dict[str, object]:
    done = api.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
    assert done.status_code == 200, done.text
    answer: dict[str, object] = done.json()
    return answer


@pytest.mark.parametrize("backend", service_backends())
def test_a_volume_written_by_one_session_is_read_by_another_and_from_outside(
    api: httpx.Client, volume: str, backend: str
) -> None:
    other = service_backends()[-1]  # the other backend where there are two
    writer = session(api, backend, {"volume_id": volume, "path": "/mnt/data"})
    reader = session(api, other, {"volume_id": volume, "path": "/data/in", "read_only": True})
    try:
        wrote = run(
            api,
            writer,
            "import os; os.makedirs('/mnt/data/out', exist_ok=True)\n"
            "open('/mnt/data/out/result.txt', 'w').write('from the writer')",
        )
        assert wrote["status"] == "ok", wrote
        read = run(api, reader, "print(open('/data/in/out/result.txt').read())")
        assert read["stdout"] == "from the writer\n", read
        refused = run(api, reader, "open('/data/in/mine.txt', 'w').write('x')")
        assert refused["status"] == "error" and "Read-only file system" in str(refused), refused
        # What sessions made, another session (another uid) may change: a shared place.
        changed = run(api, writer, "open('/mnt/data/out/result.txt', 'a').write('!')")
        assert changed["status"] == "ok", changed
        got = api.get(f"/v1/volumes/{volume}/files/out/result.txt")
        assert got.status_code == 200 and got.content == b"from the writer!"
        info = api.get(f"/v1/volumes/{volume}").json()
        assert sorted(info["mounted_by"]) == sorted({writer, reader}), info
        # Nothing of the volume is in the session's own workspace.
        assert api.get(f"/v1/sessions/{writer}/files").json() == []
    finally:
        api.delete(f"/v1/sessions/{writer}")
        api.delete(f"/v1/sessions/{reader}")


def test_files_from_outside_then_in_a_session(api: httpx.Client, volume: str) -> None:
    base = f"/v1/volumes/{volume}"
    up = api.post(f"{base}/files", params={"path": "in/a.csv"}, files={"file": ("x", b"a\n1\n")})
    assert up.status_code == 201, up.text
    assert up.json()["path"] == "in/a.csv" and up.json()["size"] == 4
    assert api.post(f"{base}/directories", params={"path": "empty/deep"}).status_code == 204
    listing = api.get(f"{base}/files", params={"recursive": True}).json()
    assert [f["path"] for f in listing] == ["empty", "empty/deep", "in", "in/a.csv"]
    sid = session(api, service_backends()[0], {"volume_id": volume, "path": "/mnt/v"})
    try:
        read = run(api, sid, "print(open('/mnt/v/in/a.csv').read().split())")
        assert read["stdout"] == "['a', '1']\n", read
        # A file written from outside is the sessions' to change too.
        assert run(api, sid, "open('/mnt/v/in/a.csv', 'a').write('2\\n')")["status"] == "ok"
    finally:
        api.delete(f"/v1/sessions/{sid}")
    assert api.get(f"{base}/files/in/a.csv").content == b"a\n1\n2\n"
    assert api.delete(f"{base}/files/in").status_code == 204
    assert api.get(f"{base}/files/in/a.csv").status_code == 404
    assert api.get(f"{base}").json()["mounted_by"] == []


@pytest.mark.parametrize(
    "path", ["../escape.txt", "a/../../escape.txt", "/etc/evil", "nul\x00byte", "line\nbreak"]
)
def test_paths_stay_inside_the_volume(api: httpx.Client, volume: str, path: str) -> None:
    r = api.post(f"/v1/volumes/{volume}/files", params={"path": path}, files={"file": ("x", b"x")})
    assert r.status_code == 400, r.text


def test_a_link_planted_in_a_volume_is_not_followed(api: httpx.Client, volume: str) -> None:
    sid = session(api, service_backends()[0], {"volume_id": volume, "path": "/mnt/v"})
    try:
        planted = run(api, sid, "import os; os.symlink('/etc', '/mnt/v/out')")
        assert planted["status"] == "ok", planted
    finally:
        api.delete(f"/v1/sessions/{sid}")
    base = f"/v1/volumes/{volume}/files"
    assert api.get(f"{base}/out/passwd").status_code in (400, 403, 404)
    up = api.post(base, params={"path": "out/x"}, files={"file": ("x", b"x")})
    assert up.status_code in (400, 403), up.text


def test_another_keys_volume_is_missing_to_it(
    server: Server, api: httpx.Client, volume: str
) -> None:
    with server.client(KEY_B) as other:
        assert other.get(f"/v1/volumes/{volume}").status_code == 404
        assert other.get("/v1/volumes").json() == []
        assert other.get(f"/v1/volumes/{volume}/files").status_code == 404
        up = other.post(f"/v1/volumes/{volume}/files", files={"file": ("x", b"x")})
        assert up.status_code == 404
        assert other.delete(f"/v1/volumes/{volume}").status_code == 404
        mount = {"volume_id": volume, "path": "/mnt/x"}
        refused = other.post("/v1/sessions", json={"volumes": [mount]})
        assert refused.status_code == 404, refused.text
    assert api.get(f"/v1/volumes/{volume}").status_code == 200


def test_a_mounted_volume_is_not_deleted(api: httpx.Client) -> None:
    made = api.post("/v1/volumes", json={"name": "kept"}).json()
    sid = session(api, service_backends()[0], {"volume_id": made["id"], "path": "/mnt/k"})
    refused = api.delete(f"/v1/volumes/{made['id']}")
    assert refused.status_code == 409 and sid in refused.text, refused.text
    api.delete(f"/v1/sessions/{sid}")
    assert api.delete(f"/v1/volumes/{made['id']}").status_code == 204
    assert api.get(f"/v1/volumes/{made['id']}").status_code == 404


def test_sizes_and_counts_are_held(api: httpx.Client) -> None:
    too_large = api.post("/v1/volumes", json={"name": "big", "size_mb": 65})
    assert too_large.status_code == 400 and "64 MiB" in too_large.text
    made = [api.post("/v1/volumes", json={"name": f"v{i}", "size_mb": 32}) for i in range(4)]
    try:
        assert [m.status_code for m in made[:3]] == [201, 201, 201]
        assert made[3].status_code == 400 and "100 MiB" in made[3].text, made[3].text
        small = api.post("/v1/volumes", json={"name": "small", "size_mb": 4})
        assert small.status_code == 201
        made.append(small)
        one_more = api.post("/v1/volumes", json={"name": "one more", "size_mb": 1})
        assert one_more.status_code == 429, one_more.text
    finally:
        for m in made:
            if m.status_code == 201:
                api.delete(f"/v1/volumes/{m.json()['id']}")


def test_a_volume_holds_no_more_than_its_size(api: httpx.Client) -> None:
    made = api.post("/v1/volumes", json={"name": "small", "size_mb": 8}).json()
    base = f"/v1/volumes/{made['id']}"
    try:
        big = api.post(f"{base}/files", files={"file": ("big", b"x" * (12 << 20))})
        assert big.status_code == 413, big.text
        sid = session(api, service_backends()[0], {"volume_id": made["id"], "path": "/mnt/s"})
        try:
            filled = run(
                api,
                sid,
                "import errno\ntry:\n"
                "    with open('/mnt/s/fill', 'wb') as f:\n"
                "        for _ in range(64): f.write(b'x' * (1 << 20)); f.flush()\n"
                "except OSError as e:\n    print(errno.errorcode[e.errno])",
            )
            assert filled["stdout"] == "ENOSPC\n", filled
        finally:
            api.delete(f"/v1/sessions/{sid}")
        assert api.get(base).json()["used_bytes"] >= 7 << 20
    finally:
        api.delete(base)


@pytest.mark.parametrize(
    "mount",
    [
        {"volume_id": "vol-000000000000000000000000", "path": "/mnt/x"},
        {"volume_id": "not-a-volume", "path": "/mnt/x"},
        {"volume_id": "vol-000000000000000000000000", "path": "/etc"},
        {"volume_id": "vol-000000000000000000000000", "path": "/mnt/../etc"},
        {"volume_id": "vol-000000000000000000000000", "path": "/workspace/data"},
        {"volume_id": "vol-000000000000000000000000", "path": "/home/user/data"},
    ],
)
def test_bad_mounts_are_refused_typed(api: httpx.Client, mount: dict[str, object]) -> None:
    refused = api.post("/v1/sessions", json={"volumes": [mount]})
    assert refused.status_code in (404, 422), refused.text
    assert refused.json()["error"]["type"] in ("VolumeNotFound", "InvalidRequest")


@pytest.mark.parametrize(
    "paths", [["/mnt/a", "/mnt/a/b"], ["/mnt/a", "/mnt/a"], ["/mnt/a", "/mnt/a-b", "/mnt/a/c"]]
)
def test_two_mounts_in_one_place_are_refused(
    api: httpx.Client, volume: str, paths: list[str]
) -> None:
    mounts = [{"volume_id": volume, "path": path} for path in paths]
    refused = api.post("/v1/sessions", json={"volumes": mounts})
    assert refused.status_code == 422 and "overlap" in refused.text, refused.text


def test_a_failed_overwrite_leaves_the_file_as_it_was(api: httpx.Client) -> None:
    made = api.post("/v1/volumes", json={"name": "small", "size_mb": 8}).json()
    base = f"/v1/volumes/{made['id']}"
    try:
        first = api.post(f"{base}/files", params={"path": "a.bin"}, files={"file": ("a", b"1")})
        assert first.status_code == 201
        big = b"x" * (9 << 20)
        again = api.post(f"{base}/files", params={"path": "a.bin"}, files={"file": ("a", big)})
        assert again.status_code == 413 and again.json()["error"]["type"] == "VolumeFull"
        assert api.get(f"{base}/files/a.bin").content == b"1"
        # A replacement is counted as what it leaves: the old file's bytes go.
        fits = b"y" * (6 << 20)
        for _ in range(2):
            put = api.post(f"{base}/files", params={"path": "a.bin"}, files={"file": ("a", fits)})
            assert put.status_code == 201, put.text
        names = [f["path"] for f in api.get(f"{base}/files").json()]
        assert names == ["a.bin"]  # nothing half-written left beside it
    finally:
        api.delete(base)


def test_a_deleted_paused_session_lets_its_volume_go(api: httpx.Client) -> None:
    made = api.post("/v1/volumes", json={"name": "freed"}).json()
    sid = session(api, service_backends()[0], {"volume_id": made["id"], "path": "/mnt/f"})
    assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
    assert api.delete(f"/v1/volumes/{made['id']}").status_code == 409
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert api.delete(f"/v1/volumes/{made['id']}").status_code == 204


def test_the_python_client_and_the_cli(server: Server) -> None:
    """Volumes through the client package and `code-interpreter volume ...`, as users reach
    them: one made by the CLI, filled by the client, read by a session the client made."""
    env = {**os.environ, "CODE_INTERPRETER_URL": server.url, "CODE_INTERPRETER_API_KEY": KEY_A}

    def cli(*args: str, given: bytes | None = None) -> bytes:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", "volume", *args],
            env=env,
            input=given,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout

    made = json.loads(cli("create", "from the cli", "--size-mb", "8"))
    volume_id = made["id"]
    try:
        cli("put", volume_id, "-", "in/notes.txt", given=b"kept between sessions")
        cli("mkdir", volume_id, "out")
        lines = cli("ls", volume_id, "-r").decode().splitlines()
        assert [line.split("\t")[::2] for line in lines] == [
            ["directory", "in"],
            ["file", "in/notes.txt"],
            ["directory", "out"],
        ]
        with Client(server.url, KEY_A) as client:
            assert [v.id for v in client.list_volumes()] == [volume_id]
            assert (
                client.download_from_volume(volume_id, "in/notes.txt") == b"kept between sessions"
            )
            mount = {"volume_id": volume_id, "path": "/mnt/notes", "read_only": True}
            session = client.create_session(volumes=[mount])
            try:
                done = client.execute(session.id, "print(open('/mnt/notes/in/notes.txt').read())")
                assert done.stdout == "kept between sessions\n", done
                assert client.get_volume(volume_id).mounted_by == [session.id]
                with pytest.raises(APIError) as in_use:
                    client.delete_volume(volume_id)
                assert in_use.value.status == 409 and in_use.value.kind == "VolumeInUse"
            finally:
                client.delete_session(session.id)
            client.upload_to_volume(volume_id, "out/r.txt", b"r")
            client.delete_from_volume(volume_id, "in")
            listed = [f.path for f in client.list_volume_files(volume_id, recursive=True)]
            assert listed == ["out", "out/r.txt"]
        assert cli("get", volume_id, "out/r.txt") == b"r"
        assert json.loads(cli("info", volume_id))["mounted_by"] == []
        assert [v["id"] for v in json.loads(cli("list"))] == [volume_id]
    finally:
        cli("delete", volume_id)
    refused = subprocess.run(
        [sys.executable, "-m", "orchestrator", "volume", "info", volume_id],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 1 and b"VolumeNotFound" in refused.stderr, refused.stderr


def test_a_keys_volumes_rule_is_held(server: Server, api: httpx.Client, volume: str) -> None:
    """`keys add --volumes read_only`: mounts read-only only, nothing made or changed; `none`:
    no volume at all. Each refusal names the rule (403)."""
    reader = add_key_to(server, f"reader-{uuid.uuid4().hex[:6]}", "--volumes", "read_only")
    nobody = add_key_to(server, f"nobody-{uuid.uuid4().hex[:6]}", "--volumes", "none")
    with server.client(reader) as client:
        made = client.post("/v1/volumes", json={"name": "mine"})
        assert made.status_code == 403 and "`volumes`" in made.text, made.text
        rw = client.post(
            "/v1/sessions", json={"volumes": [{"volume_id": volume, "path": "/mnt/x"}]}
        )
        assert rw.status_code == 403 and "read_only" in rw.text, rw.text
        assert client.get("/v1/volumes").json() == []
    with server.client(nobody) as client:
        assert client.post("/v1/volumes", json={"name": "mine"}).status_code == 403
        mount = {"volume_id": volume, "path": "/mnt/x", "read_only": True}
        assert client.post("/v1/sessions", json={"volumes": [mount]}).status_code == 403
        assert client.get("/v1/volumes").status_code == 403  # none: not even read


def test_a_policy_changed_while_paused_holds_when_it_resumes(server: Server) -> None:
    """A key made read_only while its session slept resumes with its volume read-only."""
    name = f"writer-{uuid.uuid4().hex[:6]}"
    key = add_key_to(server, name)
    with server.client(key) as client:
        made = client.post("/v1/volumes", json={"name": "w"}).json()
        sid = session(client, service_backends()[0], {"volume_id": made["id"], "path": "/mnt/w"})
        try:
            assert run(client, sid, "open('/mnt/w/a', 'w').write('1')")["status"] == "ok"
            assert client.post(f"/v1/sessions/{sid}/pause").status_code == 200
            changed = run_keys(server, "set-policy", name, "--volumes", "read_only")
            assert changed.exit_code == 0, changed.stderr
            assert eventually(  # the service has taken the new policy
                lambda: client.get("/v1/whoami").json()["policy"]["volumes"] == "read_only"
            )
            resumed = client.post(f"/v1/sessions/{sid}/resume")
            assert resumed.status_code == 200, resumed.text
            assert "read-only now" in (resumed.json()["notice"] or ""), resumed.json()
            refused = run(client, sid, "open('/mnt/w/b', 'w').write('2')")
            assert "Read-only file system" in str(refused), refused
            assert run(client, sid, "print(open('/mnt/w/a').read())")["stdout"] == "1\n"
        finally:
            client.delete(f"/v1/sessions/{sid}")
        made_id = made["id"]
    with server.client(KEY_A) as owner_a:  # another key: still not its to see
        assert owner_a.get(f"/v1/volumes/{made_id}").status_code == 404


def test_a_paused_session_keeps_its_volume_and_finds_it_again(
    api: httpx.Client, volume: str
) -> None:
    """Held while paused (not deleted under it), mounted again when it resumes."""
    sid = session(api, service_backends()[0], {"volume_id": volume, "path": "/mnt/p"})
    try:
        assert run(api, sid, "open('/mnt/p/before', 'w').write('1'); x = 5")["status"] == "ok"
        paused = api.post(f"/v1/sessions/{sid}/pause")
        assert paused.status_code == 200, paused.text
        assert api.delete(f"/v1/volumes/{volume}").status_code == 409
        api.post(
            f"/v1/volumes/{volume}/files", params={"path": "while"}, files={"file": ("w", b"2")}
        )
        resumed = run(
            api, sid, "print(x, open('/mnt/p/before').read(), open('/mnt/p/while').read())"
        )
        assert resumed["stdout"] == "5 1 2\n", resumed
    finally:
        api.delete(f"/v1/sessions/{sid}")
