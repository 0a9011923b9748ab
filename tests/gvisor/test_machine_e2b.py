"""E2B's unmodified SDK pauses and resumes a sandbox on the gvisor backend: the whole machine is
saved (a real server on 127.0.0.1, its E2B-compatible front, the `gvisor` template), so the
kernel's variables and a background command come back as they were, and the command counts on."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from e2b import SandboxQuery, SandboxState
from e2b_code_interpreter import Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.gvisor.conftest import machine_server
from tests.orchestrator.service.conftest import Server

pytestmark = pytest.mark.timeout(300)

# Writes "<its pid> <count>" ten times a second, to a file of the machine's own /tmp (the
# rename: a reader never sees it half written).
COUNTER = (
    'i=0; while true; do i=$((i+1)); echo "$$ $i" > /tmp/count.new; '
    "mv /tmp/count.new /tmp/count; sleep 0.1; done"
)
GENERATOR = (
    "def counting():\n    n = 0\n    while True:\n        n += 1\n        yield n\n"
    "c = counting()\nx = 41\nnext(c)"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server whose only backend is gvisor (E2B's template `gvisor` names it)."""
    with machine_server("gvisor") as running:
        yield running


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch, server: Server) -> Server:
    point_sdk_at(monkeypatch, server.url)
    return server


def wait_for(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    """Look again and again until `check` holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def has_counted(sbx: Sandbox) -> bool:
    """Whether the counter has written its file yet (E2B's SDK raises on a non-zero exit)."""
    return str(sbx.commands.run("if test -s /tmp/count; then echo yes; fi").stdout) == "yes\n"


def counted(sbx: Sandbox) -> tuple[int, int]:
    """(the counter's pid, its count), read inside the machine."""
    pid, count = sbx.commands.run("cat /tmp/count").stdout.split()
    return int(pid), int(count)


def test_the_sdk_pauses_and_resumes_a_whole_gvisor_machine(sdk: Server) -> None:
    sbx = Sandbox.create(template="gvisor")
    sid = sbx.sandbox_id
    try:
        assert sbx.run_code(GENERATOR).text == "1"
        counter = sbx.commands.run(COUNTER, background=True)
        wait_for(lambda: has_counted(sbx), "the counter counted")
        pid, before = counted(sbx)
        assert pid == counter.pid and pid in {p.pid for p in sbx.commands.list()}

        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert [x.sandbox_id for x in paused] == [sid]
        with sdk.client() as api:
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
        # Saved whole as a machine image, not as the kernel's variables.
        machines = list((sdk.state_dir / "gvisor-paused").iterdir())
        assert len(machines) == 1 and (machines[0] / "image").is_dir(), machines

        back = Sandbox.connect(sid)
        assert back.get_info().state == SandboxState.RUNNING
        assert back.run_code("x + 1").text == "42"
        assert back.run_code("next(c)").text == "2"  # a generator: only the machine keeps it
        assert pid in {p.pid for p in back.commands.list()}
        again, resumed_at = counted(back)
        assert again == pid and resumed_at >= before  # the same shell, its count kept
        wait_for(lambda: counted(back)[1] >= resumed_at + 5, "the counter counting on")
        assert counted(back)[0] == pid
        assert not any((sdk.state_dir / "gvisor-paused").iterdir())  # the image is spent
    finally:
        Sandbox.kill(sid)


def counts_on(sbx: Sandbox, what: str) -> int:
    """Wait until the machine's counter has counted five more; return the counter's pid."""
    pid, at = counted(sbx)
    wait_for(lambda: counted(sbx)[1] >= at + 5, what)
    return pid


def test_the_sdks_snapshot_of_a_gvisor_machine_forks_it_whole(sdk: Server) -> None:
    """E2B's snapshot of a gvisor sandbox is the whole machine: each sandbox made from it goes on
    from the same memory (a generator, which no pickle keeps) and the same running command,
    with a random stream of its own; the source runs on."""
    sbx = Sandbox.create(template="gvisor")
    made: list[str] = [sbx.sandbox_id]
    snapshot_id = None
    try:
        assert sbx.run_code(GENERATOR).text == "1"
        sbx.run_code("import random")
        counter = sbx.commands.run(COUNTER, background=True)
        wait_for(lambda: has_counted(sbx), "the counter counted")
        assert counted(sbx)[0] == counter.pid

        snap = sbx.create_snapshot(name="machine")
        snapshot_id = snap.snapshot_id
        assert snap.names == ["machine"]
        with sdk.client() as api:  # the same snapshot seen over REST: a whole-machine save
            info = api.get(f"/v1/snapshots/{snap.snapshot_id}").json()
        assert info["whole_sandbox"] is True, info
        # The source runs on after its snapshot: its counter and its kernel.
        assert counts_on(sbx, "the source's counter counting on") == counter.pid
        assert sbx.run_code("x").text == "41"

        draws = []
        for _ in range(2):
            fork = Sandbox.create(snap.snapshot_id)
            made.append(fork.sandbox_id)
            assert fork.run_code("x").text == "41"
            assert fork.run_code("next(c)").text == "2"  # memory carried, not pickled
            assert counter.pid in {p.pid for p in fork.commands.list()}  # its copy of it
            assert counts_on(fork, "the fork's counter counting on") == counter.pid
            draws.append(fork.run_code("random.random()").text)
        assert len(set(made)) == 3
        assert sbx.run_code("next(c)").text == "2"  # the forks took nothing from the source
        draws.append(sbx.run_code("random.random()").text)
        assert len(set(draws)) == 3, draws  # reseeded: no two share a random stream
    finally:
        for sid in made:
            Sandbox.kill(sid)
        if snapshot_id is not None:
            Sandbox.delete_snapshot(snapshot_id)


def test_e2b_root_and_sudo_work_on_a_machine(sdk: Server) -> None:
    """E2B's `user="root"` and `sudo`, as its users install: root's writes land in the
    machine's own root filesystem; the sandbox's user cannot write there itself."""
    sbx = Sandbox.create(template="gvisor")
    try:
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        sbx.commands.run("mkdir -p /opt/tool && echo v1 > /opt/tool/version", user="root")
        assert sbx.commands.run("cat /opt/tool/version").stdout == "v1\n"
        assert sbx.commands.run("sudo -n id -u").stdout.strip().splitlines()[-1] == "0"
        assert sbx.commands.run("test -w /opt/tool || echo no").stdout == "no\n"
        # E2B's file calls as root, outside the workspace: written, read, listed as root's.
        sbx.files.write("/opt/tool/config", "by root", user="root")
        sbx.files.make_dir("/opt/tool/more", user="root")
        assert sbx.files.read("/opt/tool/config", user="root") == "by root"
        listed = {e.name for e in sbx.files.list("/opt/tool", user="root")}
        assert {"config", "more", "version"} <= listed, listed
        owners = sbx.commands.run("stat -c %U /opt/tool/config /opt/tool/more").stdout
        assert owners == "root\nroot\n", owners
        with pytest.raises(Exception, match=r"(?i)permission denied"):
            sbx.files.write("/opt/tool/mine", "not root's")

        def started() -> list[dict[str, Any]]:
            with sdk.client() as api:
                query = {"session_id": sbx.sandbox_id, "kind": "process.started", "limit": 100}
                events: list[dict[str, Any]] = api.get("/v1/audit", params=query).json()["events"]
            return events

        # The audit log says which commands ran as root (its writes are batched: looked again).
        wait_for(lambda: len(started()) >= 4, "the commands' audit events")
        ids = sorted(
            (e["details"].get("user") or "", e["details"]["command"])
            for e in started()
            if "id -u" in e["details"]["command"]
        )
        assert [user for user, _ in ids] == ["", "root"], ids
        assert "sudo" in ids[0][1] and "sudo" not in ids[1][1], ids
    finally:
        sbx.kill()
