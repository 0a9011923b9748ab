"""The Agents SDK provider's persistence through a real service: a Runner-owned sandbox ends (or
pauses) at an approval and the run resumes from the SDK's serialized state; snapshots of the
service named after the SDK's snapshot ids keep variables as well as files; an unsafe archive
is refused before the live workspace is touched; the workspace archive changes nothing that
the SDK's fingerprint sees and leaves out exactly the paths it is asked to.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import RunConfig, Runner, RunState, function_tool
from agents.run_config import SandboxRunConfig
from agents.sandbox import SandboxAgent
from agents.sandbox.capabilities import Filesystem, Shell
from agents.sandbox.errors import WorkspaceArchiveWriteError
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.events import SandboxSessionEvent, SandboxSessionFinishEvent
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.sinks import CallbackSink
from agents.sandbox.snapshot import LocalSnapshot, LocalSnapshotSpec

from code_interpreter_client.agents_sandbox import (
    CodeInterpreterSandboxClient,
    CodeInterpreterSandboxClientOptions,
    CodeInterpreterSandboxSession,
)
from code_interpreter_client.http_client import APIError, Client
from tests.clients.test_agents_sandbox import ScriptedModel, Step
from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(default_backend=service_backends()[0]).start()
    yield srv
    with srv.client() as api:
        assert api.get("/v1/sessions").json() == [], "a test left a session behind"
        assert api.get("/v1/snapshots").json() == [], "a test left a snapshot behind"
    srv.stop()
    assert leftovers(srv) == [], "the provider left sandboxes behind"


class Events:
    """The SDK's sandbox events, as its instrumentation reports them."""

    def __init__(self) -> None:
        self.seen: list[SandboxSessionEvent] = []

    def sink(self) -> Instrumentation:
        def record(event: SandboxSessionEvent, session: BaseSandboxSession) -> None:
            self.seen.append(event)

        return Instrumentation(sinks=[CallbackSink(record, mode="sync")])

    def finished(self, op: str) -> int:
        return sum(
            1 for e in self.seen if isinstance(e, SandboxSessionFinishEvent) and e.op == op and e.ok
        )


@function_tool(needs_approval=True)
def publish(note: str) -> str:
    """Publish a note (a person approves first)."""
    return f"published {note}"


def worker(model: ScriptedModel) -> SandboxAgent[Any]:
    return SandboxAgent(
        name="worker", model=model, capabilities=[Filesystem(), Shell()], tools=[publish]
    )


def count_hydrates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the SDK restores a workspace (it calls the provider's own method, which
    still does its work: the list only counts)."""
    calls: list[int] = []
    real = CodeInterpreterSandboxSession.hydrate_workspace

    async def counted(self: CodeInterpreterSandboxSession, data: io.IOBase) -> None:
        calls.append(1)
        await real(self, data)

    monkeypatch.setattr(CodeInterpreterSandboxSession, "hydrate_workspace", counted)
    return calls


@pytest.mark.parametrize("pause_on_exit", [False, True], ids=["end", "pause"])
async def test_a_runner_owned_sandbox_resumes_after_an_approval(
    server: Server,
    backend_name: str,
    tmp_path: Path,
    pause_on_exit: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run 1 writes a file and stops at an approval: the Runner persists and shuts the sandbox
    down (ends it, or pauses it). Run 2, from the serialized RunState, reads the file: from the
    snapshot in a new session, or in the same session woken with its workspace as it was."""
    events = Events()
    client = CodeInterpreterSandboxClient(
        base_url=server.url, api_key=KEY_A, instrumentation=events.sink()
    )
    options = CodeInterpreterSandboxClientOptions(backend=backend_name, pause_on_exit=pause_on_exit)
    config = RunConfig(
        tracing_disabled=True,
        sandbox=SandboxRunConfig(
            client=client, options=options, snapshot=LocalSnapshotSpec(base_path=tmp_path)
        ),
    )
    # The model is shown every tool output so far: run 2 carries on from its third turn.
    steps: list[Step] = [
        ("exec_command", {"cmd": "echo hello > greeting.txt"}),
        ("publish", {"note": "hi"}),
        ("exec_command", {"cmd": "cat greeting.txt"}),
    ]
    first = ScriptedModel(steps)
    result = await Runner.run(worker(first), "Write and publish.", run_config=config)
    assert result.interruptions, "the approval did not interrupt the run"
    state = result.to_state()
    sandbox = state._sandbox
    assert sandbox is not None and sandbox["backend_id"] == "code_interpreter"
    session_state = sandbox["session_state"]
    assert session_state["snapshot"]["type"] == "local"
    assert session_state["pause_on_exit"] is pause_on_exit
    assert (tmp_path / f"{session_state['session_id']}.tar").is_file()
    assert [events.finished(op) for op in ("stop", "shutdown")] == [1, 1]
    first_code_session = session_state["code_session_id"]
    with Client(server.url, KEY_A) as api:
        paused = [s.id for s in api.list_sessions("paused")]
        assert [s.id for s in api.list_sessions("running")] == []
    assert paused == ([first_code_session] if pause_on_exit else [])

    second = ScriptedModel(steps)
    restored = await RunState.from_json(worker(second), json.loads(json.dumps(state.to_json())))
    restored.approve(restored.get_interruptions()[0])
    hydrates = count_hydrates(monkeypatch)
    try:
        result = await Runner.run(worker(second), restored, run_config=config)
    finally:
        await client.close()
    assert result.final_output == "done"
    published, read_back = second.outputs[1:]
    assert published == "published hi" and "hello" in read_back, second.outputs
    after = result.to_state()._sandbox
    assert after is not None
    same_session = after["session_state"]["code_session_id"] == first_code_session
    assert same_session is pause_on_exit
    # Woken from a pause, its workspace still matches the snapshot: nothing to restore.
    assert len(hydrates) == (0 if pause_on_exit else 1)
    with Client(server.url, KEY_A) as api:
        left = api.list_sessions()
        for info in left:  # a paused session outlives the run: that is its point
            api.delete_session(info.id)
    assert [s.state for s in left] == (["paused"] if pause_on_exit else [])


async def test_persisting_the_workspace_changes_nothing_its_fingerprint_sees(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    """The SDK fingerprints the workspace before it persists it, and skips the restore on a
    resume when the workspace still matches: making the archive must not change it."""
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(backend=backend_name)
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    try:
        await session.start()
        # Times long past: the archive made now would show in them if it touched the root.
        setup = "echo hi > a.txt && mkdir -p d && echo x > d/b.txt && touch -d @1000000000 ."
        assert (await session.exec(setup)).ok()
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        before = await inner._compute_and_cache_snapshot_fingerprint()
        (await inner.persist_workspace()).close()
        after = await inner._compute_and_cache_snapshot_fingerprint()
        assert after == before, "persisting the workspace changed it"
        listed = await session.exec("stat -c %Y . && ls -A")
        assert listed.stdout == b"1000000000\na.txt\nd\n", listed.stdout
    finally:
        await session.shutdown()
        await client.close()


async def test_left_out_paths_are_paths_not_patterns(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(backend=backend_name)
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    try:
        await session.start()
        assert (await session.exec("echo 1 > 'log*' && echo 2 > logbook.txt")).ok()
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        inner.register_persist_workspace_skip_path("log*")
        archive = await inner.persist_workspace()
        with tarfile.open(fileobj=io.BytesIO(archive.read())) as tar:
            names = set(tar.getnames())
        assert "./logbook.txt" in names and "./log*" not in names, names
    finally:
        await session.shutdown()
        await client.close()


async def test_a_woken_session_keeps_its_variables_and_gets_back_what_the_pause_lost(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    """pause_on_exit: shut down, the session is paused, not ended; resumed, it is the same
    session with its kernel's variables, and its files' modes and links."""
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(backend=backend_name, pause_on_exit=True)
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    async with session:
        setup = "printf 'echo ran' > run.sh && chmod 755 run.sh && ln -s run.sh link.sh"
        assert (await session.exec(setup)).ok()
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        await inner.code_session.execute("counter = 7")
        code_session_id = inner.code_session.session_id
    assert not await session.running()
    with Client(server.url, KEY_A) as api:
        assert [(s.id, s.state) for s in api.list_sessions()] == [(code_session_id, "paused")]
    await client.delete(session)  # a paused session is left to the service
    with Client(server.url, KEY_A) as api:
        assert [s.id for s in api.list_sessions("paused")] == [code_session_id]

    state = client.deserialize_session_state(client.serialize_session_state(session.state))
    resumed = await client.resume(state)
    try:
        await resumed.start()
        inner = resumed._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        assert inner.code_session.session_id == code_session_id
        assert (await inner.code_session.execute("counter * 6")).text == "42"
        ran = await resumed.exec("./link.sh && test -L link.sh")
        assert ran.ok() and ran.stdout == b"ran\n", (ran.stdout, ran.stderr)
    finally:
        resumed.state.pause_on_exit = False  # this time it ends
        await resumed.shutdown()
        await client.close()
    with Client(server.url, KEY_A) as api:
        assert api.list_sessions() == []


def unsafe_tar(kind: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        if kind == "parent":
            info = tarfile.TarInfo("../escaped.txt")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
        else:
            info = tarfile.TarInfo("./link")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["parent", "absolute-link"])
async def test_an_unsafe_snapshot_is_refused_before_the_workspace_is_cleared(
    server: Server, backend_name: str, tmp_path: Path, kind: str
) -> None:
    """A resume whose workspace drifted from its snapshot restores the snapshot; one with a
    member that would land outside the workspace is refused, and the live files stay."""
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(backend=backend_name)
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    try:
        await session.start()
        await session.stop()  # a snapshot of the (empty) workspace, and its fingerprint
        assert (await session.exec("echo precious > keep.txt")).ok()  # drift
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        with pytest.raises(WorkspaceArchiveWriteError) as refused:
            await inner.hydrate_workspace(io.BytesIO(unsafe_tar(kind)))
        assert refused.value.context.get("reason"), refused.value.context
        (tmp_path / f"{session.state.session_id}.tar").write_bytes(unsafe_tar(kind))

        state = client.deserialize_session_state(client.serialize_session_state(session.state))
        resumed = await client.resume(state)  # the same, live session: preserved
        with pytest.raises(WorkspaceArchiveWriteError):
            await resumed.start()
        kept = await session.exec("cat keep.txt")
        assert kept.ok() and kept.stdout == b"precious\n", kept
    finally:
        await session.shutdown()
        await client.close()


async def test_a_named_service_snapshot_keeps_variables_and_files(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    """workspace_persistence="snapshot": stopping takes a service snapshot named after the
    SDK's snapshot id; a new sandbox made from that SDK snapshot starts from it, variables and
    all. Deleted on the service, it can no longer be restored, and says so."""
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(
        backend=backend_name, workspace_persistence="snapshot"
    )
    named = LocalSnapshot(id="named-1", base_path=tmp_path)
    api = Client(server.url, KEY_A)
    try:
        session = await client.create(snapshot=named, options=options)
        async with session:
            assert (await session.exec("echo kept > kept.txt")).ok()
            inner = session._inner
            assert isinstance(inner, CodeInterpreterSandboxSession)
            await inner.code_session.execute("answer = 41")
        # Stopped twice under one name (the SDK's single slot): the service keeps the latest.
        again = await client.create(snapshot=named, options=options)
        async with again:
            inner = again._inner
            assert isinstance(inner, CodeInterpreterSandboxSession)
            assert (await again.exec("cat kept.txt")).stdout == b"kept\n"
            seen = await inner.code_session.execute("answer + 1")
            assert seen.text == "42", seen
            await inner.code_session.execute("answer = 99")
        assert api.list_sessions() == []
        (snapshot,) = api.list_snapshots()
        assert snapshot.name == "named-1" and snapshot.variables >= 1, snapshot
        assert (tmp_path / "named-1.tar").read_bytes().startswith(b"CODE_INTERPRETER_SNAPSHOT_V1")

        third = await client.create(snapshot=named, options=options)
        async with third:
            inner = third._inner
            assert isinstance(inner, CodeInterpreterSandboxSession)
            assert (await inner.code_session.execute("answer")).text == "99"
            api.delete_snapshot(snapshot.id)
            third.state.snapshot = LocalSnapshot(id="scratch", base_path=tmp_path)
        api.delete_snapshot(api.list_snapshots()[0].id)  # what the stop above took

        gone = await client.create(snapshot=named, options=options)
        try:
            with pytest.raises(WorkspaceArchiveWriteError) as failed:
                await gone.start()
            assert failed.value.context["reason"] == "native_snapshot_restore_failed"
            assert failed.value.context["snapshot_id"] == snapshot.id
        finally:
            await gone.shutdown()
    finally:
        for leftover in api.list_snapshots():
            api.delete_snapshot(leftover.id)
        api.close()
        await client.close()


async def test_a_service_snapshot_that_cannot_leave_paths_out_becomes_a_tar(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(
        backend=backend_name, workspace_persistence="snapshot"
    )
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    try:
        await session.start()
        assert (await session.exec("echo 1 > cache.bin && echo 2 > kept.txt")).ok()
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        inner.register_persist_workspace_skip_path("cache.bin")
        archive = (await inner.persist_workspace()).read()
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            names = set(tar.getnames())
        assert "./kept.txt" in names and "./cache.bin" not in names, names
        with Client(server.url, KEY_A) as api:
            assert api.list_snapshots() == []
    finally:
        await session.shutdown()
        await client.close()


async def test_embedded_sandboxes_refuse_pause_and_service_snapshots() -> None:
    client = CodeInterpreterSandboxClient()
    for options in (
        CodeInterpreterSandboxClientOptions(pause_on_exit=True),
        CodeInterpreterSandboxClientOptions(workspace_persistence="snapshot"),
    ):
        with pytest.raises(ValueError, match="needs a running service"):
            await client.create(options=options)


async def test_a_resume_that_fails_leaves_the_paused_session_to_try_again(
    server: Server, backend_name: str, tmp_path: Path
) -> None:
    """pause_on_exit: the service cannot wake the paused session (its saved state does not
    read) and says it stays paused, nothing lost. The client's resume fails with that; it must
    not end the session on its way out, so a resume once the state reads again finds it."""
    client = CodeInterpreterSandboxClient(base_url=server.url, api_key=KEY_A)
    options = CodeInterpreterSandboxClientOptions(backend=backend_name, pause_on_exit=True)
    session = await client.create(snapshot=LocalSnapshotSpec(base_path=tmp_path), options=options)
    saved = server.state_dir / "snapshots"
    before = set(saved.iterdir()) if saved.is_dir() else set()
    async with session:
        inner = session._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        await inner.code_session.execute("counter = 7")
        code_session_id = inner.code_session.session_id
    (paused_state,) = set(saved.iterdir()) - before
    report = paused_state / "state.json"
    kept = report.read_bytes()
    report.write_text("not a report")
    state = client.deserialize_session_state(client.serialize_session_state(session.state))
    try:
        with pytest.raises(APIError) as failed:
            await client.resume(state)
        assert failed.value.status == 503, failed.value
        with Client(server.url, KEY_A) as api:
            assert [(s.id, s.state) for s in api.list_sessions()] == [
                (code_session_id, "paused")
            ], "a failed resume ended the paused session"
        report.write_bytes(kept)
        resumed = await client.resume(state)
        inner = resumed._inner
        assert isinstance(inner, CodeInterpreterSandboxSession)
        assert inner.code_session.session_id == code_session_id
        assert (await inner.code_session.execute("counter * 6")).text == "42"
        resumed.state.pause_on_exit = False  # this time it ends
        await resumed.shutdown()
    finally:
        await client.close()
        with Client(server.url, KEY_A) as api:
            for left in api.list_sessions():
                api.delete_session(left.id)
