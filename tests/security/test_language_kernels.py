"""Attacks through the kernels of other languages and the supervisor in front of them."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def host_unix_listener() -> Iterator[Path]:
    """A Unix socket on the host that no sandbox may make the service connect to."""
    where = Path(tempfile.mkdtemp(prefix="cir-host-sock-", dir="/tmp"))
    path = where / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.settimeout(0.1)
    try:
        yield path
        with pytest.raises(TimeoutError):  # nothing ever connected
            server.accept()
    finally:
        server.close()
        path.unlink(missing_ok=True)
        where.rmdir()


async def test_a_planted_interrupt_socket_link_is_never_followed(
    backend: Backend, bystander: Sandbox, host_unix_listener: Path
) -> None:
    """R's kernel is interrupted through a socket in its kernel directory. Code that replaces
    that socket with a link to a host socket gets no connection made on its behalf: the link is
    refused (or cannot be planted), the time limit still ends the call, and the session goes
    on."""
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(**image))
    try:
        planted = await sb.execute(
            "ok <- suppressWarnings(file.remove('/run/kernel/interrupt')) && "
            f"file.symlink('{host_unix_listener}', '/run/kernel/interrupt'); cat(ok)",
            language="r",
            timeout_s=120,
        )
        assert planted.status is ExecutionStatus.OK, planted
        spun = await sb.execute("while (TRUE) {}", language="r", timeout_s=2)
        assert spun.status is ExecutionStatus.TIMEOUT, spun
        after = await sb.execute("cat(1 + 1)", language="r", timeout_s=120)
        assert after.stdout == "2"
    finally:
        await sb.close()


async def _answers_again(sb: Sandbox) -> None:
    """Deno's kernel publishes late output with the parent of whatever request runs then, so a
    flood's tail lands in later calls until it is drained: the kernel answers again after."""
    answers = []
    for _ in range(30):
        answers.append(await sb.execute("1 + 1", language="javascript", timeout_s=60))
        if answers[-1].results and answers[-1].results[0].text == "2":
            return
        await asyncio.sleep(1)
    raise AssertionError(f"the kernel never answered again: {[a.status for a in answers]}")


async def test_a_flood_from_a_relayed_kernel_is_capped(backend: Backend) -> None:
    """Deno's kernel reaches the host through the supervisor's relay: a flood of output from
    it is capped as Python's is, and the kernel goes on. (Deno's kernel itself holds a lot of
    memory for a flood of lines, ~0.8 GB for 100 000: more is its own death by the sandbox's
    memory limit, reported and recovered like any other.)"""
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(**image))
    try:
        flood = await sb.execute(
            "for (let i = 0; i < 20000; i++) console.log('x'.repeat(100));",
            language="javascript",
            timeout_s=120,
        )
        assert flood.status is ExecutionStatus.OK, flood.error
        assert len(flood.stdout) <= sb.spec.output_limit_chars + 1000
        await _answers_again(sb)
    finally:
        await sb.close()


async def test_an_output_over_the_cap_from_a_relayed_kernel_is_never_held(
    backend: Backend,
) -> None:
    """One output over the cap: never held; the output connection is reset and made again,
    which may cost the next call or so its output (the relay delivers the big message late),
    never the kernel."""
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(**image))
    try:
        big = await sb.execute(
            "Deno.jupyter.html`${'y'.repeat(60_000_000)}`", language="js", timeout_s=120
        )
        assert big.status is ExecutionStatus.OK, big.error
        assert not any(r.html and len(r.html) > 1_000_000 for r in big.results)
        await _answers_again(sb)
    finally:
        await sb.close()
