"""The E2B process service's pure rules: how an end reads in envd's words, which users may run
a process, where E2B's working directories are, and what a watcher reports."""

from __future__ import annotations

import base64
import signal

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_pb import EventType

from code_interpreter_wire.processes import ProcessEnd
from orchestrator.e2b_compatible.paths import in_sandbox, in_workspace, to_sandbox_cwd
from orchestrator.e2b_compatible.processes import check_user, end_event
from orchestrator.e2b_compatible.watchers import changes

pytestmark = pytest.mark.unit


def test_an_end_reads_as_envd_says_it() -> None:
    ok = end_event(ProcessEnd(exit_code=0))
    assert (ok.exit_code, ok.exited, ok.status, ok.has_field("error")) == (
        0,
        True,
        "exit status 0",
        False,
    )
    failed = end_event(ProcessEnd(exit_code=3, error="it exited with status 3"))
    assert (failed.exit_code, failed.status, failed.error) == (3, "exit status 3", "exit status 3")
    killed = end_event(ProcessEnd(exit_code=None, signal=signal.SIGKILL))
    assert (killed.exit_code, killed.exited, killed.status) == (-1, False, "signal: killed")
    timed = end_event(
        ProcessEnd(
            exit_code=None,
            signal=signal.SIGTERM,
            timed_out=True,
            error="killed after its time limit",
        )
    )
    assert timed.exit_code == -1 and timed.error == "signal: SIGTERM: killed after its time limit"


def _basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


@pytest.mark.parametrize("header", [None, "", _basic("user"), _basic("sandbox"), "Bearer k"])
def test_the_sandbox_user_may_run_processes(header: str | None) -> None:
    assert check_user(header) is None


def test_root_is_asked_for_and_the_sandbox_decides() -> None:
    """Root is the sandbox's to give (a gVisor machine has one; elsewhere the service refuses
    it with the way out: tests/clients/e2b_sdk/test_sdk_commands.py)."""
    assert check_user(_basic("root")) == "root"


@pytest.mark.parametrize("header", [_basic("alice"), "Basic !!not-base64!!"])
def test_other_users_are_unauthenticated(header: str) -> None:
    with pytest.raises(ConnectError) as refused:
        check_user(header)
    assert refused.value.code == Code.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("cwd", "where"),
    [
        ("", None),
        ("/home/user", "/workspace"),
        ("/home/user/src", "/workspace/src"),
        ("~", "/workspace"),
        ("src", "/workspace/src"),
        ("/", "/"),
        ("/tmp/x/..", "/tmp"),
    ],
)
def test_e2b_working_directories(cwd: str, where: str | None) -> None:
    assert to_sandbox_cwd(cwd) == where


def test_which_paths_the_files_api_reaches() -> None:
    assert in_workspace("/home/user/a") and in_workspace("a") and in_workspace("/workspace")
    assert not in_workspace("/tmp/a") and not in_workspace("/home/username")
    assert in_sandbox("/home/userx") == "/home/userx"


def test_a_watcher_reports_what_changed_by_name() -> None:
    before = {"a": ("file", 1, 1.0), "d": ("directory", 0, 1.0), "gone": ("file", 1, 1.0)}
    after = {"a": ("file", 2, 2.0), "d": ("directory", 0, 5.0), "d/new": ("file", 0, 3.0)}
    assert changes(before, after) == [
        ("gone", EventType.REMOVE),
        ("a", EventType.WRITE),
        ("d/new", EventType.CREATE),
    ]
    assert changes(after, after) == []
