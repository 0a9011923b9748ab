"""CodeSession.embedded is a front door: it runs through an in-process Service, on both backends."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from code_interpreter_client.code_session import CodeSession
from code_interpreter_wire.rest import ExecutionRecord
from code_interpreter_wire.results import ExecutionStatus, OutputEvent, StdoutEvent
from orchestrator.embedded_session import embedded_settings
from sandbox import Backend
from tests.conftest import small_spec


async def test_an_embedded_call_is_run_and_kept_by_the_service(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its private state dir goes
    session = CodeSession.embedded(backend, small_spec())
    try:
        execution = await session.execute("x = 41\nx + 1")
        # Only the service makes a record: the execution counted, kept, and given its ids.
        assert isinstance(execution, ExecutionRecord)
        assert execution.session_id == session.session_id and execution.execution_id
        assert execution.text == "42"
        [base] = tmp_path.iterdir()  # a directory per user, one per process below it
        assert base.name == f"code-interpreter-embedded-{os.getuid()}"
        [own] = base.iterdir()
        assert own.name == str(os.getpid())
        assert len(list(own.iterdir())) == 1  # this session's service
        await session.upload("data/in.txt", b"hello")
        assert await session.download("data/in.txt") == b"hello"
        assert [f.path for f in await session.list_files("data")] == ["data/in.txt"]
    finally:
        await session.close()
    assert not own.exists()  # the service's state dir went with it, and this process's dir
    # A backend handed in is the caller's: it still makes sandboxes after the session closed.
    async with await backend.create(small_spec()) as sandbox:
        assert (await sandbox.execute("1 + 1")).status is ExecutionStatus.OK


def test_a_sync_caller_and_an_async_caller_share_one_session(code_session: CodeSession) -> None:
    code_session.execute_sync("total = 40")
    assert code_session.execute_sync("total + 2").text == "42"
    code_session.close_sync()
    assert code_session.session_id is None
    # Closed, it starts a fresh session on the next call: the variable is gone.
    assert code_session.execute_sync("'total' in globals()").text == "False"


def test_the_environment_does_not_configure_an_embedded_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A served instance's settings (here, invalid ones) are not the embedded session's.
    monkeypatch.setenv("CODE_INTERPRETER_MAX_UPLOAD_BYTES", "0")
    monkeypatch.setenv("CODE_INTERPRETER_HOST_TOOLS", "not json")
    monkeypatch.setenv("CODE_INTERPRETER_CONFIG", str(tmp_path / "missing.toml"))

    settings = embedded_settings("docker", small_spec(default_timeout_s=7.0), tmp_path)

    # Files move within the process: as large as the workspace can hold.
    workspace_bytes = small_spec().limits.workspace_size_mb << 20
    assert settings.max_upload_bytes == workspace_bytes
    assert settings.host_tools.session_default == []
    assert settings.backends == ["docker"] and settings.default_backend == "docker"
    assert settings.execution_timeout_s == 7.0 and settings.pool_size == 0
    assert settings.state_dir == tmp_path and settings.auth_disabled


async def test_events_reach_the_caller_as_they_happen(code_session: CodeSession) -> None:
    """`on_event` sees each output while the code runs, embedded as remotely."""
    seen: list[str] = []

    async def sink(event: OutputEvent) -> None:
        if isinstance(event, StdoutEvent):
            seen.append(event.text)

    execution = await code_session.execute(
        "import time\nprint('a', flush=True)\ntime.sleep(0.5)\nprint('b')", on_event=sink
    )
    assert "".join(seen) == "a\nb\n" == execution.stdout
