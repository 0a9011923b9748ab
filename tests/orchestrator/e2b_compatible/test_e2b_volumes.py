"""E2B's `Volume` API and `volume_mounts`, with E2B's unmodified SDK against a real server on
each backend that mounts volumes: a volume written from outside is read in a sandbox, what the
sandbox writes is read from outside; another key's volume is not found; a mounted one is kept."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    SandboxException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)
from e2b.volume.volume_async import AsyncVolume
from e2b.volume.volume_sync import Volume
from e2b_code_interpreter import Sandbox
from starlette.requests import Request

from code_interpreter_wire.errors import FileAccessError, FileTooLarge
from code_interpreter_wire.volumes import VolumeMount
from orchestrator.config import Settings
from orchestrator.e2b_compatible.errors import E2BError, error_response
from orchestrator.e2b_compatible.sandboxes import (
    SANDBOX_LABEL,
    E2BRecord,
    SandboxGone,
    _restored,
    _saved,
)
from orchestrator.e2b_compatible.volume_content import _caller
from orchestrator.e2b_compatible.volumes import (
    TOKEN_TTL_S,
    TokenRefused,
    _read_or_make_key,
    check_token,
    sign_token,
)
from orchestrator.governance.principals import Principals, owner_of
from orchestrator.service_parts.volumes import VolumeInUse
from orchestrator.settings_sections import AuthSection
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.governance.conftest import add_key_to, eventually, run_keys
from tests.orchestrator.service.conftest import (
    KEY_A,
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)

pytestmark = pytest.mark.timeout(300)
MOUNTING = [b for b in service_backends() if b in ("local", "docker")] or ["local"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(
        volume_default_size_mb=32, max_volume_bytes_per_key=200 << 20, max_volumes_per_key=8
    ).start()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, server: Server) -> Server:
    """E2B's SDK at the server: its volume content API too (E2B_VOLUME_API_URL)."""
    point_sdk_at(monkeypatch, server.url)
    monkeypatch.setenv("E2B_VOLUME_API_URL", server.url)
    return server


@pytest.fixture
def volume(sdk: Server, request: pytest.FixtureRequest) -> Iterator[Volume]:
    made = Volume.create(f"vol-{request.node.name}"[:60])
    yield made
    Volume.destroy(made.volume_id)


@pytest.mark.parametrize("template", MOUNTING)
def test_written_outside_read_inside_written_inside_read_outside(
    volume: Volume, template: str
) -> None:
    volume.make_dir("/in")
    volume.write_file("/in/sales.csv", "month,revenue\n1,10\n2,12\n")
    sbx = Sandbox.create(template=template, volume_mounts={"/mnt/sales": volume})
    try:
        read = sbx.run_code(
            "import pandas as pd\nint(pd.read_csv('/mnt/sales/in/sales.csv').revenue.sum())"
        )
        assert read.error is None and read.text == "22", read
        assert sbx.files.read("/mnt/sales/in/sales.csv").startswith("month,revenue")
        wrote = sbx.commands.run("mkdir -p /mnt/sales/out && echo total 22 > /mnt/sales/out/r")
        assert wrote.exit_code == 0, wrote
        info = sbx.get_info()
        assert info.volume_mounts == [{"name": volume.name, "path": "/mnt/sales"}]
        # Mounted: not destroyed (E2B's 409, which its SDK raises as a VolumeException).
        with pytest.raises(VolumeException, match=r"409.*VolumeInUse"):
            Volume.destroy(volume.volume_id)
        # A context made beside the default one sees the same volume, as in E2B's VM.
        ctx = sbx.create_code_context()
        seen = sbx.run_code("print(open('/mnt/sales/out/r').read(), end='')", context=ctx)
        assert seen.logs.stdout == ["total 22\n"], seen
    finally:
        sbx.kill()
    assert volume.read_file("/out/r") == "total 22\n"
    listed = volume.list("/", depth=2)
    assert sorted(e.path for e in listed) == ["/in", "/in/sales.csv", "/out", "/out/r"]


def test_mounted_by_name_and_refused_mounts(volume: Volume) -> None:
    volume.write_file("hello.txt", b"hi")
    with Sandbox.create(volume_mounts={"/data/v": volume.name}) as sbx:
        assert sbx.files.read("/data/v/hello.txt") == "hi"
        listed = [x for x in Sandbox.list().next_items() if x.sandbox_id == sbx.sandbox_id]
        assert listed[0].volume_mounts == [{"name": volume.name, "path": "/data/v"}]
    with pytest.raises(SandboxException, match=r"404.*VolumeNotFound"):
        Sandbox.create(volume_mounts={"/mnt/x": "no such volume"})
    with pytest.raises(SandboxException, match=r"400.*mount"):
        Sandbox.create(volume_mounts={"/etc/x": volume})


def test_list_get_and_destroy(sdk: Server) -> None:
    made = Volume.create("listed")
    try:
        assert made.volume_id.startswith("vol-") and made.name == "listed" and made.token
        assert [v.name for v in Volume.list() if v.volume_id == made.volume_id] == ["listed"]
        by_id = Volume.get_info(made.volume_id)
        by_name = Volume.get_info("listed")
        assert by_id.volume_id == by_name.volume_id == made.volume_id
        assert by_id.token and by_id.token.startswith("e2bvol_")  # a new one, good for a day
        connected = Volume.connect(made.volume_id)
        connected.write_file("/x.txt", "x")
        assert made.read_file("/x.txt", format="bytes") == b"x"
        with pytest.raises(VolumeException, match=r"409.*VolumeExists"):
            Volume.create("listed")
    finally:
        assert Volume.destroy(made.volume_id) is True
    assert Volume.destroy(made.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(made.volume_id)
    assert made.volume_id not in [v.volume_id for v in Volume.list()]


def test_files_from_outside(volume: Volume) -> None:
    written = volume.write_file("/a/b/c.txt", "abc")
    assert written.path == "/a/b/c.txt" and written.size == 3 and written.name == "c.txt"
    made = volume.make_dir("/d/e", force=True)
    assert made.path == "/d/e" and made.type.value == "directory"
    with pytest.raises(VolumePathNotFoundException):
        volume.make_dir("/missing/parent")
    assert [e.path for e in volume.list("/")] == ["/a", "/d"]
    assert [e.path for e in volume.list("/a", depth=2)] == ["/a/b", "/a/b/c.txt"]
    info = volume.get_info("/a/b/c.txt")
    assert info.type.value == "file" and info.size == 3
    assert volume.get_info("/").type.value == "directory"
    assert volume.exists("/a/b") and not volume.exists("/a/nothing")
    assert volume.read_file("/a/b/c.txt", format="bytes") == b"abc"
    assert b"".join(volume.read_file("/a/b/c.txt", format="stream")) == b"abc"
    with pytest.raises(VolumePathNotFoundException):
        volume.read_file("/a/missing.txt")
    with pytest.raises(VolumeException, match=r"400.*uid, gid and mode"):
        volume.update_metadata("/a/b/c.txt", mode=0o600)
    with pytest.raises(VolumeException, match=r"400.*InvalidPath"):
        volume.write_file("/../escape.txt", "x")
    volume.remove("/a")
    assert not volume.exists("/a/b/c.txt")
    with pytest.raises(VolumePathNotFoundException):
        volume.remove("/a")


def test_a_large_directory_hides_nothing(sdk: Server) -> None:
    """A file past the first 10,000 of its directory is found, and a listing `depth` deep
    walks no deeper (a large deep directory first hides none of what follows it)."""
    with sdk.client() as client:
        made = client.post("/v1/volumes", json={"name": "large dir", "size_mb": 96})
        assert made.status_code == 201, made.text
    volume = Volume.connect(made.json()["id"])
    try:
        volume.write_file("/z.txt", "z")  # (its image mounted on the host now, where it is one)
        many = sdk.state_dir / "volumes" / volume.volume_id / "data" / "a" / "many"
        many.mkdir(parents=True)
        for i in range(10_001):
            (many / f"f{i:05}").touch()
        assert volume.get_info("/a/many/f10000").type.value == "file"
        listed = [e.path for e in volume.list("/", depth=2)]
        assert listed == ["/a", "/a/many", "/z.txt"]
    finally:
        Volume.destroy(volume.volume_id)


def test_another_keys_volume_is_not_found(sdk: Server, volume: Volume) -> None:
    assert volume.volume_id not in [v.volume_id for v in Volume.list(api_key=KEY_B)]
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(volume.volume_id, api_key=KEY_B)
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(volume.name, api_key=KEY_B)
    assert Volume.destroy(volume.volume_id, api_key=KEY_B) is False
    with pytest.raises(SandboxException, match=r"404.*VolumeNotFound"):
        Sandbox.create(api_key=KEY_B, volume_mounts={"/mnt/x": volume.name})
    # B's own token opens B's volume, not A's; a made-up one opens nothing.
    theirs = Volume.create("theirs", api_key=KEY_B)
    try:
        stolen = Volume(volume.volume_id, volume.name, token=theirs.token)
        with pytest.raises(AuthenticationException):
            stolen.read_file("/anything")
        forged = Volume(volume.volume_id, volume.name, token="e2bvol_a2V5LWE.AAAA")
        with pytest.raises(AuthenticationException):
            forged.list("/")
        # B's API key in place of the token: B's volumes only.
        with_key = Volume(volume.volume_id, volume.name, token=KEY_B)
        with pytest.raises(NotFoundException):
            with_key.list("/")
    finally:
        Volume.destroy(theirs.volume_id, api_key=KEY_B)


def test_content_calls_need_a_token_before_the_body_is_read(sdk: Server, volume: Volume) -> None:
    """The gate settles the caller first: a large upload without a token is refused at once."""
    url = f"{sdk.url}/volumecontent/{volume.volume_id}/file"
    with httpx.Client(timeout=60) as http:
        refused = http.put(url, params={"path": "x"}, content=b"x" * (1 << 20))
        assert refused.status_code == 401 and refused.json()["code"] == 401
        headers = {"Authorization": f"Bearer {volume.token}"}
        big = b"y" * (20 << 20)  # past the ordinary request limit (16 MiB): an upload's
        stored = http.put(url, params={"path": "big.bin"}, content=big, headers=headers)
        assert stored.status_code == 201, stored.text
        assert http.get(url, params={"path": "big.bin"}, headers=headers).content == big
        with_key = http.get(url, params={"path": "big.bin"}, headers={"X-API-Key": KEY_A})
        assert with_key.status_code == 200 and len(with_key.content) == len(big)
        full = http.put(url, params={"path": "more.bin"}, content=big, headers=headers)
        assert full.status_code == 413 and "VolumeFull" in full.json()["message"], full.text
        # A gzip body is stored as it was before it was compressed.
        zipped = {**headers, "Content-Encoding": "gzip"}
        put = http.put(
            url, params={"path": "z.txt"}, content=gzip.compress(b"z" * 9), headers=zipped
        )
        assert put.status_code == 201 and put.json()["size"] == 9, put.text
        assert http.get(url, params={"path": "z.txt"}, headers=headers).content == b"z" * 9


def test_a_paused_sandbox_keeps_its_volume(volume: Volume) -> None:
    """Paused, it still holds the volume (not destroyed under it); resumed, it mounts it again."""
    sbx = Sandbox.create(template=MOUNTING[0], volume_mounts={"/mnt/p": volume})
    try:
        sbx.commands.run("echo before > /mnt/p/f")
        sbx.pause()
        with pytest.raises(VolumeException, match=r"409"):
            Volume.destroy(volume.volume_id)
        volume.write_file("/g", "while paused")
        resumed = Sandbox.connect(sbx.sandbox_id)
        seen = resumed.commands.run("cat /mnt/p/f /mnt/p/g")
        assert seen.stdout == "before\nwhile paused", seen
    finally:
        sbx.kill()


async def test_the_async_volume(sdk: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncVolume alike, its content API at the `/e2b` sub-path this time."""
    monkeypatch.setenv("E2B_VOLUME_API_URL", f"{sdk.url}/e2b")
    made = await AsyncVolume.create("async one")
    try:
        await made.write_file("/n.txt", "n")
        assert await made.read_file("/n.txt") == "n"
        assert [e.path for e in await made.list("/")] == ["/n.txt"]
    finally:
        assert await AsyncVolume.destroy(made.volume_id) is True


def _said(exc: Exception, *, named: bool) -> tuple[int, str]:
    answer = error_response(exc, named=named)
    return answer.status_code, json.loads(bytes(answer.body))["message"]


def test_the_volume_routes_name_our_refusals_the_others_do_not() -> None:
    """The volume routes' refusals say their type (E2B's body has no field for it); the rest of
    the E2B front answers as E2B does (test_e2b_errors.py)."""
    assert _said(VolumeInUse("mounted"), named=True) == (409, "VolumeInUse: mounted")
    assert _said(FileAccessError("a link"), named=True) == (400, "FileAccessError: a link")
    assert _said(FileTooLarge("big"), named=True) == (413, "FileTooLarge: big")
    assert _said(E2BError(404, "VolumeNotFound: x"), named=True) == (404, "VolumeNotFound: x")
    gone = SandboxGone("sbx-1")
    assert _said(gone, named=True) == (502, str(gone))
    assert _said(VolumeInUse("mounted"), named=False) == (409, "mounted")


async def test_a_content_call_takes_the_owner_the_request_gate_found() -> None:
    """The token is checked once, by the gate (request_guard.py): the route takes its answer
    from the request's state (here with no authenticator to check it again)."""
    request = Request({"type": "http", "state": {"volume_caller": "owner-1"}, "headers": []})
    assert await _caller(request, service=None) == "owner-1"  # type: ignore[arg-type]


def test_a_sandboxs_volumes_are_kept_with_its_record() -> None:
    """A restart finds them again: a resumed sandbox's new contexts mount them too."""
    mount = VolumeMount(volume_id="vol-" + "0" * 24, path="/mnt/v")
    record = E2BRecord("s-1", "s-1", "key-a", "token", "base", volumes=[mount])
    restored = _restored("s-1", "key-a", {SANDBOX_LABEL: _saved(record)})
    assert restored is not None and restored.volumes == [mount]


# --- volume tokens: a day long, and only while their key works
def _server_key(server: Server) -> bytes:
    return (server.state_dir / "volumes" / ".e2b-volume-token-key").read_bytes()


def test_an_expired_token_is_refused(volume: Volume, sdk: Server) -> None:
    key, owner = _server_key(sdk), owner_of(KEY_A)
    now = int(time.time())
    fresh = Volume(
        volume.volume_id, volume.name, token=sign_token(key, owner, volume.volume_id, now)
    )
    fresh.write_file("/t.txt", "t")  # signed as the service signs: good
    old = sign_token(key, owner, volume.volume_id, now - TOKEN_TTL_S - 1)
    with pytest.raises(AuthenticationException, match="expired"):
        Volume(volume.volume_id, volume.name, token=old).read_file("/t.txt")
    # Signed for a key the service no longer has (taken out of its settings): refused.
    gone = sign_token(key, owner_of("a key taken out"), volume.volume_id, now)
    with pytest.raises(AuthenticationException, match="no longer"):
        Volume(volume.volume_id, volume.name, token=gone).read_file("/t.txt")
    # The first tokens had no time, and so no end: refused.
    assert volume.token is not None
    named, _, mac = volume.token.split(".")
    with pytest.raises(AuthenticationException):
        Volume(volume.volume_id, volume.name, token=f"{named}.{mac}").read_file("/t.txt")


def test_a_revoked_keys_token_is_refused(sdk: Server) -> None:
    """(Its volume is left to the server's end, which unmounts it: a revoked key deletes
    nothing.)"""
    name = f"vol-revoked-{os.getpid()}-{time.monotonic_ns()}"
    key = add_key_to(sdk, name)
    made = Volume.create("kept", api_key=key)
    made.write_file("/f.txt", "f")
    revoked = run_keys(sdk, "revoke", name)
    assert revoked.exit_code == 0, revoked.stderr

    def refused() -> bool:
        try:
            made.read_file("/f.txt")
        except AuthenticationException as exc:
            return "revoked" in str(exc)
        return False

    assert eventually(refused)


def test_tokens_checked(tmp_path: Path) -> None:
    key = _read_or_make_key(tmp_path / "volumes")
    token = sign_token(key, "owner-1", "vol-a", 1_000_000)
    assert check_token(key, token, "vol-a", 1_000_000 + TOKEN_TTL_S - 1) == "owner-1"
    refusals = [
        (token, "vol-b", 1_000_001, "does not open"),  # another volume's
        (token, "vol-a", 1_000_000 + TOKEN_TTL_S, "expired"),
        (token, "vol-a", 1_000_000 - 3600, "future"),
        (sign_token(b"x" * 32, "owner-1", "vol-a", 1_000_000), "vol-a", 1_000_001, "not open"),
        (token.replace(".1000000.", ".1000001."), "vol-a", 1_000_001, "does not open"),
        (token + ".x", "vol-a", 1_000_001, "does not open"),
    ]
    for given, volume_id, now, said in refusals:
        with pytest.raises(TokenRefused, match=said) as refused:
            check_token(key, given, volume_id, now)
        assert refused.value.guessed == ("open" in said), given


def test_the_token_key_is_made_once_whole_and_a_damaged_one_stops_the_start(
    tmp_path: Path,
) -> None:
    volumes = tmp_path / "volumes"
    key = _read_or_make_key(volumes)
    made = volumes / ".e2b-volume-token-key"
    assert len(key) == 32 and _read_or_make_key(volumes) == key
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert [p.name for p in volumes.iterdir()] == [made.name]  # nothing left aside
    made.write_bytes(key[:10])
    with pytest.raises(RuntimeError, match="damaged"):
        _read_or_make_key(volumes)


def test_only_a_current_keys_owner_is_current(tmp_path: Path) -> None:
    """A key taken out of the settings is no longer current (its tokens open nothing)."""
    settings = Settings(api_keys=["kept"], state_dir=tmp_path)
    principals = Principals(AuthSection.of(settings), None)
    assert principals.is_current(owner_of("kept"))
    assert not principals.is_current(owner_of("removed"))
