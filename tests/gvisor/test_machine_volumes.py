"""Volumes in gVisor machines (the gvisor backend: raw runsc): host directories bound by the
machine's OCI config at their places, read-only where asked, and kept across a pause, whose
saved machine wakes only with volumes at the same places (docs/volumes.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import DirectoryMount
from sandbox.backends.gvisor.backend import GvisorBackend
from sandbox.backends.gvisor.machine import ImageUnusable
from sandbox.backends.gvisor.machine_images import (
    read_manifest,
    saved_volume_places,
    write_manifest,
)
from tests.conftest import small_spec


@pytest.fixture
def volumes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two host directories standing for volumes (as the service makes them: any uid writes)."""
    shared, data = tmp_path / "shared", tmp_path / "data"
    for directory in (shared, data):
        directory.mkdir()
        directory.chmod(0o777)
    tmp_path.chmod(0o755)
    (data / "input.csv").write_text("a,b\n1,2\n")
    yield shared, data


def mounts(shared: Path, data: Path) -> list[DirectoryMount]:
    return [
        DirectoryMount(source=str(shared), path="/mnt/shared"),
        DirectoryMount(source=str(data), path="/data/in", read_only=True),
    ]


async def test_a_machine_mounts_volumes_read_write_and_read_only(
    gvisor: GvisorBackend, volumes: tuple[Path, Path]
) -> None:
    shared, data = volumes
    assert GvisorBackend.capabilities.mounts
    sb = await gvisor.create(small_spec(mounts=mounts(shared, data)))
    try:
        wrote = await sb.execute(
            "open('/mnt/shared/out.txt', 'w').write('from the machine')\n"
            "open('/data/in/input.csv').read()"
        )
        assert wrote.text == "'a,b\\n1,2\\n'", wrote
        assert (shared / "out.txt").read_text() == "from the machine"
        refused = await sb.run_command(ProcessRequest(command="touch /data/in/new 2>&1; echo $?"))
        assert "Read-only file system" in refused.stdout, refused
        assert not (data / "new").exists()
        (shared / "from-host.txt").write_text("seen inside")
        seen = await sb.run_command(ProcessRequest(command="cat /mnt/shared/from-host.txt"))
        assert seen.stdout == "seen inside", seen
    finally:
        await sb.close()
    assert (shared / "out.txt").exists()  # the volume outlives the machine


async def test_a_paused_machine_wakes_with_its_volumes_and_only_with_them(
    gvisor: GvisorBackend, volumes: tuple[Path, Path]
) -> None:
    shared, data = volumes
    spec = small_spec(mounts=mounts(shared, data))
    sb = await gvisor.create(spec)
    try:
        await sb.execute("f = open('/mnt/shared/log.txt', 'a'); f.write('before\\n'); f.flush()")
        handle = await sb.suspend()
    except BaseException:
        await sb.close()
        raise
    assert handle is not None
    (shared / "while-paused.txt").write_text("written while it slept")
    # Its mount table is the saved one: volumes elsewhere (or none) are refused, typed.
    try:
        for other in ([], [DirectoryMount(source=str(shared), path="/mnt/elsewhere")]):
            with pytest.raises(ImageUnusable, match="volumes mounted at"):
                await gvisor.wake(handle, small_spec(mounts=other))
        woken = await gvisor.wake(handle, spec)
    except BaseException:
        await gvisor.discard(handle)
        raise
    try:
        await gvisor.woken(handle)
        # The file it held open goes on where it was; what the host wrote meanwhile is there.
        went_on = await woken.execute(
            "f.write('after\\n'); f.close()\nopen('/mnt/shared/while-paused.txt').read()"
        )
        assert went_on.text == "'written while it slept'", went_on
        assert (shared / "log.txt").read_text() == "before\nafter\n"
    finally:
        await woken.close()


@pytest.mark.parametrize(
    "volumes",
    ["/mnt/x", [{"path": "/mnt/x"}], [{"path": 1, "read_only": False}], ["/mnt/x"], {"a": 1}],
)
def test_a_manifest_with_volumes_it_cannot_read_is_unusable_typed(
    tmp_path: Path, volumes: object
) -> None:
    manifest = {"runsc": "v", "image": "i", "uid": 1, "kernels": {}, "volumes": volumes}
    write_manifest(tmp_path, manifest)
    with pytest.raises(ImageUnusable, match="no readable manifest"):
        read_manifest(tmp_path, "v")
    # A save from before volumes (none kept) reads as having none.
    write_manifest(tmp_path, {k: v for k, v in manifest.items() if k != "volumes"})
    assert saved_volume_places(read_manifest(tmp_path, "v")) == []
