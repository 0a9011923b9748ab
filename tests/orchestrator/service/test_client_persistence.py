"""The Python client's pause, resume and snapshots, against a real server: `Client` (blocking,
over `AsyncClient`) and a remote `CodeSession`, with the service's typed errors."""

from __future__ import annotations

import pytest

from code_interpreter_client import APIError, Client, CodeSession
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, service_backends


def test_the_client_pauses_resumes_and_starts_sessions_from_snapshots(server: Server) -> None:
    with Client(server.url, KEY_A) as api:
        sid = api.create_session().id
        snapshot_id = None
        made: list[str] = [sid]
        try:
            assert api.execute(sid, "kept = 41").status == "ok"
            api.upload(sid, "notes.txt", b"remember")

            paused = api.pause(sid)
            assert paused.state == "paused" and paused.paused_at is not None, paused
            assert sid in [s.id for s in api.list_sessions("paused")]
            assert sid not in [s.id for s in api.list_sessions("running")]
            assert api.get_session(sid).state == "paused"  # looking does not wake it

            resumed = api.resume(sid)
            assert resumed.session.state == "running" and resumed.notice, resumed
            assert api.execute(sid, "kept + 1").text == "42"

            info = api.snapshot(sid, "base")
            snapshot_id = info.id
            assert info.name == "base" and info.session_id == sid and info.files >= 1, info
            assert snapshot_id in [s.id for s in api.list_snapshots()]
            assert api.get_snapshot(snapshot_id) == info
            with Client(server.url, KEY_B) as other:  # another key's snapshot is not there
                with pytest.raises(APIError) as hidden:
                    other.get_snapshot(snapshot_id)
                assert hidden.value.status == 404

            started = api.create_session(snapshot_id=snapshot_id).id
            made.append(started)
            assert api.execute(started, "kept").text == "41"
            assert api.download(started, "notes.txt") == b"remember"
        finally:
            for made_id in made:
                api.delete_session(made_id)
            if snapshot_id is not None:
                api.delete_snapshot(snapshot_id)
        assert snapshot_id not in [s.id for s in api.list_snapshots()]
        with pytest.raises(APIError) as gone:
            api.delete_snapshot(snapshot_id)
        assert gone.value.status == 404 and gone.value.kind, gone.value
        with pytest.raises(APIError) as missing:
            api.pause("s-does-not-exist")
        assert missing.value.status == 404, missing.value


async def test_a_remote_code_session_pauses_resumes_and_snapshots(server: Server) -> None:
    session = CodeSession.remote(server.url, KEY_A)
    snapshot_id = None
    try:
        await session.execute("import math\ncircle = math.pi")
        assert (await session.pause()).state == "paused"
        assert (await session.state()).state == "paused"
        notice = await session.resume()
        assert notice is not None and "restored" in notice, notice
        assert (await session.execute("round(circle, 2)")).text == "3.14"

        info = await session.snapshot("pi")
        snapshot_id = info.id
        assert snapshot_id in [s.id for s in await session.list_snapshots()]
        async with CodeSession.remote(server.url, KEY_A, snapshot_id=snapshot_id) as copy:
            assert (await copy.execute("round(circle, 3)")).text == "3.142"
    finally:
        await session.close()
        if snapshot_id is not None:
            await session.delete_snapshot(snapshot_id)
    with Client(server.url, KEY_A) as api:
        assert snapshot_id not in [s.id for s in api.list_snapshots()]


def test_a_session_to_reuse_and_a_snapshot_to_start_from_are_not_both_given(
    server: Server,
) -> None:
    with pytest.raises(ValueError, match="not both"):
        CodeSession.remote(server.url, KEY_A, "s-1", snapshot_id="snap-1")


@pytest.mark.parametrize("backend", service_backends())
def test_a_plain_pause_keeps_file_modes_and_links(server: Server, backend: str) -> None:
    """docs/client.md and docs/persistence.md on what a pause keeps of the files: an
    executable's mode and a symbolic link come back with a plain pause and resume."""
    with Client(server.url, KEY_A) as api:
        sid = api.create_session(backend=backend).id
        try:
            made = api.execute(
                sid,
                "import os\nopen('run.sh', 'w').write('echo ran')\nos.chmod('run.sh', 0o755)\n"
                "os.symlink('run.sh', 'link.sh')",
            )
            assert made.status == "ok", made
            assert api.pause(sid).state == "paused"
            api.resume(sid)
            seen = api.execute(
                sid,
                "import os, stat\n"
                "print(oct(stat.S_IMODE(os.stat('run.sh').st_mode)), os.path.islink('link.sh'),"
                " os.readlink('link.sh'))",
            )
            assert seen.stdout.split() == ["0o755", "True", "run.sh"], seen
        finally:
            api.delete_session(sid)


def test_an_id_is_one_path_segment_not_a_path(server: Server) -> None:
    """A snapshot id the client is handed (by a model, from a store) is sent as one segment:
    one made of `..` and slashes is a missing snapshot, never another route of the key's
    (`DELETE /v1/snapshots/../sessions/<id>` would end that session)."""
    with Client(server.url, KEY_A) as api:
        sid = api.create_session().id
        try:
            with pytest.raises(APIError) as missing:
                api.delete_snapshot(f"../sessions/{sid}")
            assert missing.value.status == 404, missing.value
            with pytest.raises(APIError):
                api.get_snapshot(f"../sessions/{sid}")
            assert api.get_session(sid).state == "running", "a snapshot call reached the session"
        finally:
            api.delete_session(sid)
