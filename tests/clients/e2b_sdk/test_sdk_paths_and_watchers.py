"""E2B's file calls on the paths its clients use (its home `/home/user`, `/tmp`), `files.rename`
and `files.watch_dir` (sync polling and async streaming), unmodified SDK, on each backend."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from e2b import FilesystemEventType, InvalidArgumentException, NotFoundException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.clients.e2b_sdk.test_sdk_commands import eventually
from tests.orchestrator.service.conftest import Server


def test_e2b_home_is_the_workspace(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/notes.txt", "n")
    assert sbx.files.read("/workspace/notes.txt") == "n"
    assert sbx.run_code("open('notes.txt').read()").text == "n"
    assert "notes.txt" in [e.name for e in sbx.files.list("/home/user")]
    assert sbx.files.get_info("/home/user/notes.txt").path == "/workspace/notes.txt"
    assert sbx.files.exists("~/notes.txt")


def test_paths_outside_the_workspace_are_the_sandboxs_own(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/deep/er/blob.bin", bytes(range(256)) * 1000)
    assert sbx.files.read("/tmp/deep/er/blob.bin", format="bytes") == bytes(range(256)) * 1000
    # Commands see the very file (the sandbox's private /tmp).
    assert sbx.commands.run("wc -c < /tmp/deep/er/blob.bin").stdout.strip() == "256000"
    assert sbx.files.get_info("/tmp/deep/er/blob.bin").size == 256_000
    assert [e.name for e in sbx.files.list("/tmp/deep")] == ["er"]
    sbx.files.remove("/tmp/deep")
    assert not sbx.files.exists("/tmp/deep")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/missing.txt")
    with pytest.raises(NotFoundException):
        sbx.files.list("/workspace/no/such/dir")  # never a silently empty listing


def test_file_calls_as_root_are_refused_where_the_sandbox_has_none(sbx: Sandbox) -> None:
    """E2B's `user="root"` on a file call outside the workspace: a local or Docker sandbox has
    no root (a gVisor machine does: tests/gvisor/test_machine_e2b.py); refused, saying so."""
    for call in (
        lambda: sbx.files.write("/tmp/by-root.txt", "x", user="root"),
        lambda: sbx.files.read("/tmp/by-root.txt", user="root"),
        lambda: sbx.files.make_dir("/tmp/by-root", user="root"),
    ):
        with pytest.raises(Exception, match="no root") as refused:
            call()
        assert "gvisor" in str(refused.value), refused.value
    assert not sbx.files.exists("/tmp/by-root.txt") and not sbx.files.exists("/tmp/by-root")


def test_rename_makes_parents_and_a_missing_source_is_not_found(sbx: Sandbox) -> None:
    sbx.files.write("old.txt", "o")
    moved = sbx.files.rename("old.txt", "/home/user/a/b/new.txt")
    assert moved.path == "/workspace/a/b/new.txt" and moved.name == "new.txt"
    assert sbx.files.read("a/b/new.txt") == "o" and not sbx.files.exists("old.txt")
    sbx.files.rename("a/b/new.txt", "/tmp/out.txt")  # across the workspace's edge
    assert sbx.commands.run("cat /tmp/out.txt").stdout == "o"
    with pytest.raises(NotFoundException):
        sbx.files.rename("nothing-here.txt", "x.txt")


def test_watch_dir_polls_create_write_remove_relative_to_the_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("watched/inner")
    sbx.files.write("watched/gone.txt", "g")
    handle = sbx.files.watch_dir("/home/user/watched", recursive=True)
    sbx.files.write("watched/inner/new.txt", "n")
    sbx.files.remove("watched/gone.txt")
    time.sleep(1.1)  # a new modification time, even on a coarse clock
    events = {(e.name, e.type) for e in handle.get_new_events()}
    assert ("inner/new.txt", FilesystemEventType.CREATE) in events
    assert ("gone.txt", FilesystemEventType.REMOVE) in events
    sbx.files.write("watched/inner/new.txt", "longer now")
    assert {(e.name, e.type) for e in handle.get_new_events()} == {
        ("inner/new.txt", FilesystemEventType.WRITE)
    }
    assert handle.get_new_events() == []
    handle.stop()
    with pytest.raises(InvalidArgumentException, match="workspace"):
        sbx.files.watch_dir("/tmp")


@pytest.fixture
async def asbx(e2b_env: Server, template: str) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(template=template)
    yield sandbox
    await sandbox.kill()


async def test_async_watch_dir_streams_events(asbx: AsyncSandbox) -> None:
    await asbx.files.make_dir("streamed")
    seen: list[tuple[str, object]] = []
    handle = await asbx.files.watch_dir(
        "/workspace/streamed", lambda e: seen.append((e.name, e.type)), timeout=60
    )
    await asbx.files.write("/home/user/streamed/made.txt", "x")
    arrived = await eventually(lambda: ("made.txt", FilesystemEventType.CREATE) in seen)
    await handle.stop()
    assert arrived, seen
