"""What a command started through the E2B front cannot do to the server or to another sandbox:
endless output that no client reads keeps the server's memory bounded (a stream's backlog is
capped, the rest dropped), and a sandbox's private paths are its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import NotFoundException
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import Server


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_endless_output_nobody_reads_keeps_the_server_bounded(
    e2b_env: Server, sbx: Sandbox
) -> None:
    assert e2b_env.process is not None
    before = _rss_mb(e2b_env.process.pid)
    # The sync SDK returns a background handle and reads nothing until asked.
    flood = sbx.commands.run("yes 0123456789abcdef", background=True, timeout=120)
    time.sleep(8)
    grown = _rss_mb(e2b_env.process.pid) - before
    assert grown < 200, f"the server grew by {grown:.0f} MB for an unread stream"
    assert sbx.commands.kill(flood.pid) is True
    assert sbx.run_code("1 + 1").text == "2"
    assert sbx.commands.run("echo still").stdout == "still\n"


def test_a_sandboxs_tmp_is_its_own(e2b_env: Server, sbx: Sandbox, template: str) -> None:
    sbx.files.write("/tmp/secret.txt", "mine")
    other = Sandbox.create(template=template)
    try:
        with pytest.raises(NotFoundException):
            other.files.read("/tmp/secret.txt")
        assert other.commands.run("cat /tmp/secret.txt 2>&1 || true").stdout.strip() != "mine"
    finally:
        other.kill()
    assert sbx.files.read("/tmp/secret.txt") == "mine"
