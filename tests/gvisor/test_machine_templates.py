"""Templates and forks of gVisor machines (docs/gvisor.md, "Templates and forks"): sandboxes
restored from one saved machine have its memory, yet no key or random stream in common, and
start as clean as a fresh one."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import create_backend
from sandbox.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from sandbox.backends.gvisor.machine import ImageUnusable
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import require_backend

LOOK = (
    "import json, random, sys, numpy\n"
    "from ipykernel.kernelapp import IPKernelApp\n"
    "with open(IPKernelApp.instance().connection_file) as f:\n"
    "    on_file = json.load(f)['key']\n"
    "print(json.dumps({'key': get_ipython().kernel.session.key.decode(), 'on_file': on_file,"
    " 'draw': random.random(), 'numpy': float(numpy.random.random()),"
    " 'pandas': 'pandas' in sys.modules, 'names': sorted(n for n in globals()"
    " if not n.startswith('_')), 'history': len(In)}))"
)


@pytest.fixture(scope="module")
async def gvisor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GvisorBackend]:
    require_backend("gvisor")
    state = tmp_path_factory.mktemp("gv-templates", numbered=True)
    # One template at most: a sandbox of another spec starts cold, and makes none.
    backend = create_backend("gvisor", state_dir=state, max_templates=1)
    assert isinstance(backend, GvisorBackend)
    yield backend
    await backend.close()


async def until_true(condition: Callable[[], object], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.02)


async def look(sb: GvisorSandbox) -> dict[str, object]:
    done = await sb.execute(LOOK)
    assert done.ok and done.execution_count == 1, done
    found: dict[str, object] = json.loads(done.stdout)
    return found


async def test_sandboxes_from_one_template_are_clean_warm_and_share_no_secret(
    gvisor: GvisorBackend,
) -> None:
    spec = SandboxSpec()
    cold = await gvisor.create(spec)  # the first of its spec: started, and a template made
    try:
        template = await gvisor.prepare_templates(spec)
        restored = [await gvisor.create(spec) for _ in range(2)]
        try:
            fresh = await look(cold)
            seen = [await look(sb) for sb in restored]
        finally:
            for sb in restored:
                await sb.close()
    finally:
        await cold.close()
    assert fresh["pandas"] is False and all(s["pandas"] is True for s in seen)  # preloaded
    # As clean as a fresh one: the same names, no history, its first execution counted 1.
    assert all(s["names"] == fresh["names"] and s["history"] == fresh["history"] for s in seen)
    template_key = json.loads((template / "manifest.json").read_text())["kernels"]["python"]
    keys = {str(s["key"]) for s in seen}
    assert len(keys) == 2 and template_key["key"] not in keys  # each re-keyed, apart
    assert all(s["key"] == s["on_file"] for s in seen)  # the file inside says its own key
    assert seen[0]["draw"] != seen[1]["draw"] and seen[0]["numpy"] != seen[1]["numpy"]


async def test_another_spec_starts_cold_and_a_corrupt_template_is_dropped(
    gvisor: GvisorBackend,
) -> None:
    spec = SandboxSpec()
    template = await gvisor.prepare_templates(spec)
    other = await gvisor.create(SandboxSpec(limits=ResourceLimits(memory_mb=768)))
    try:  # its machine holds other limits: not restored from this template
        assert (await other.execute("import sys; 'pandas' in sys.modules")).text == "False"
    finally:
        await other.close()
    for image_file in (template / "image").iterdir():
        with image_file.open("r+b") as f:
            f.truncate(max(0, image_file.stat().st_size // 3))
    sb = await gvisor.create(spec)  # the template fails to restore: started instead
    try:
        assert (await sb.execute("6 * 7")).text == "42"
    finally:
        await sb.close()
    assert not (template / "manifest.json").exists()  # dropped, to be made again


async def test_a_machine_saved_whole_runs_on_and_a_corrupt_save_forks_nothing(
    gvisor: GvisorBackend, tmp_path: Path
) -> None:
    sb = await gvisor.create(SandboxSpec(limits=ResourceLimits(memory_mb=768)))
    try:
        await sb.execute("x = 41")
        saved = await sb.save_whole(tmp_path / "whole", max_bytes=1 << 32)
        assert saved is not None and saved.machine and saved.machine_bytes > 0
        assert (await sb.execute("x + 1")).text == "42"  # it ran on
        broken = tmp_path / "broken"
        shutil.copytree(tmp_path / "whole", broken)
        (broken / "manifest.json").write_text("{")
        with pytest.raises(ImageUnusable):
            await gvisor.fork(broken, sb.spec)
        # A listening TCP socket: this gVisor cannot save it, so no whole save is made.
        await sb.execute("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()")
        assert await sb.save_whole(tmp_path / "refused", max_bytes=1 << 32) is None
        assert not (tmp_path / "refused").exists()
        assert (await sb.execute("x")).text == "41"
    finally:
        await sb.close()


async def test_a_save_keeps_a_commands_output_and_waits_for_no_cell(
    gvisor: GvisorBackend, tmp_path: Path
) -> None:
    sb = await gvisor.create(SandboxSpec(limits=ResourceLimits(memory_mb=768)))
    try:
        lines = "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.5; done"
        command = asyncio.ensure_future(sb.run_command(ProcessRequest(command=lines)))
        await until_true(lambda: len(sb.list_processes()) > 0)
        running = asyncio.ensure_future(sb.execute("import time; time.sleep(2); 'slept'"))
        await until_true(lambda: sb.is_busy)
        with pytest.raises(SandboxError, match="running code"):
            await sb.save_whole(tmp_path / "busy", max_bytes=1 << 32)
        assert (await running).text == "'slept'"
        assert await sb.save_whole(tmp_path / "whole", max_bytes=1 << 32) is not None
        done = await command  # followed again after the save, what it wrote meanwhile first
        assert done.exit_code == 0 and done.stdout.split() == [f"line{i}" for i in range(1, 7)]
    finally:
        await sb.close()


async def test_a_fork_whose_kernel_will_not_take_its_new_key_fails_loudly(
    gvisor: GvisorBackend, tmp_path: Path
) -> None:
    sb = await gvisor.create(SandboxSpec(limits=ResourceLimits(memory_mb=768)))
    try:
        await sb.execute("exec = lambda *args, **kwargs: None  # the session's own, shadowing")
        assert await sb.save_whole(tmp_path / "whole", max_bytes=1 << 32) is not None
    finally:
        await sb.close()
    with pytest.raises(SandboxError, match="key could not be changed"):
        await gvisor.fork(tmp_path / "whole", sb.spec)


async def test_another_image_is_never_restored_from_this_images_template(
    gvisor: GvisorBackend,
) -> None:
    limits = ResourceLimits(memory_mb=768)  # the spec whose template the tests above made
    await gvisor.prepare_templates(SandboxSpec(limits=limits))
    full = await gvisor.create(SandboxSpec(image=FULL_IMAGE, limits=limits))
    try:
        assert {"r", "javascript"} <= set(full.languages), full.languages
        assert (await full.execute("import sys; 'pandas' in sys.modules")).text == "False"
    finally:
        await full.close()
