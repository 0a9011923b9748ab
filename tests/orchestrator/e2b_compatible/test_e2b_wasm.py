"""A wasm sandbox through the E2B front (docs/wasm.md), with E2B's unmodified SDK: the template
`wasm` runs Python and moves files as any sandbox does; what it cannot do (commands, other
languages) is refused, saying why, and the sandbox carries on."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox

from tests.conftest import require_backend
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import Server, leftovers, make_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_backend("wasm")
    made = make_server(backends="local,wasm", default_backend="local").start()
    yield made
    made.stop()
    assert leftovers(made) == []
    shutil.rmtree(made.state_dir.parent, ignore_errors=True)


@pytest.fixture
def sandbox(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    point_sdk_at(monkeypatch, server.url)
    made = Sandbox.create(template="wasm")
    yield made
    made.kill()


def test_python_runs_and_files_move_through_the_sdk(sandbox: Sandbox) -> None:
    assert sandbox.run_code("import sys\nn = 6").error is None
    ran = sandbox.run_code("print('in', sys.platform); n * 7")
    assert (ran.text, ran.logs.stdout) == ("42", ["in emscripten\n"])
    failed = sandbox.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    sandbox.files.write("/home/user/notes/a.txt", "hello")
    assert sandbox.files.read("/home/user/notes/a.txt") == "hello"
    assert [e.name for e in sandbox.files.list("/home/user/notes")] == ["a.txt"]
    read = sandbox.run_code("open('notes/a.txt').read().upper()")
    assert read.text == "HELLO", read  # E2B's server drops a string's quotes


def test_what_a_wasm_sandbox_cannot_do_is_refused_saying_why(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match="cannot run processes"):
        sandbox.commands.run("echo hi")
    refused: str
    try:
        other = sandbox.run_code("1 + 1", language="javascript")
        refused = str(other.error)
    except SandboxException as exc:
        refused = str(exc)
    assert "not installed in this sandbox; it has: python." in refused, refused
    assert sandbox.run_code("2 + 2").text == "4"  # it carries on
