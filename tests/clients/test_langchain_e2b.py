"""`langchain-e2b`, the Deep Agents backend for E2B, unmodified, on our E2B front: every one of
its operations (execute, read, write, edit, ls, glob, grep) on each backend. Before the front
served processes, execute failed and ls/glob came back as silently empty lists."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox
from langchain_e2b import E2BSandbox

from tests.e2b_sdk_fixtures import e2b_env, e2b_server, template

__all__ = ["e2b_env", "e2b_server", "template"]  # the fixtures, used here by name


@pytest.fixture
def backend(e2b_env: object, template: str) -> Iterator[E2BSandbox]:
    sandbox = Sandbox.create(template=template)
    try:
        yield E2BSandbox(sandbox=sandbox)  # its default workdir: E2B's /home/user
    finally:
        sandbox.kill()


def test_execute_runs_in_the_home_with_exit_codes(backend: E2BSandbox) -> None:
    done = backend.execute("pwd; echo err >&2")
    assert (done.exit_code, done.output) == (0, "/workspace\n\nerr\n")
    failed = backend.execute("echo nope; exit 5")
    assert failed.exit_code == 5 and "nope" in failed.output
    timed_out = backend.execute("sleep 30", timeout=2)
    assert timed_out.exit_code == 124


def test_write_read_edit(backend: E2BSandbox) -> None:
    written = backend.write("/workspace/docs/a.txt", "alpha\nbeta\ngamma\n")
    assert written.error is None
    assert backend.write("/workspace/docs/a.txt", "again").error is not None  # exists already
    read = backend.read("/workspace/docs/a.txt")
    assert read.error is None and read.file_data is not None
    assert "beta" in str(read.file_data["content"])
    edited = backend.edit("/workspace/docs/a.txt", "beta", "BETA")
    assert edited.error is None
    assert backend.execute("cat /workspace/docs/a.txt").output.startswith("alpha\nBETA\n")
    big_old, big_new = "x" * 30_000 + "\n", "y" * 30_000 + "\n"  # edited through files in /tmp
    assert backend.write("/workspace/big.txt", big_old).error is None
    assert backend.edit("/workspace/big.txt", big_old, big_new).error is None
    assert backend.download_files(["/workspace/big.txt"])[0].content == big_new.encode()


def test_ls_glob_grep_find_what_is_there(backend: E2BSandbox) -> None:
    backend.upload_files(
        [("/workspace/src/one.py", b"needle = 1\n"), ("/workspace/src/two.txt", b"no\nneedle\n")]
    )
    listed = backend.ls("/workspace/src")
    assert listed.error is None and listed.entries is not None
    assert sorted(e["path"] for e in listed.entries) == [
        "/workspace/src/one.py",
        "/workspace/src/two.txt",
    ]
    found = backend.glob("**/*.py", path="/workspace")
    assert found.error is None and found.matches is not None
    assert [m["path"] for m in found.matches] == ["src/one.py"]
    grepped = backend.grep("needle", path="/workspace/src")
    assert grepped.error is None and grepped.matches is not None
    assert sorted((m["path"], m["line"]) for m in grepped.matches) == [
        ("/workspace/src/one.py", 1),
        ("/workspace/src/two.txt", 2),
    ]
