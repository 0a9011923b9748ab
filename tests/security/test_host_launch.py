"""How the host starts a local sandbox: nothing a session sets or writes may choose what the host
runs, see the host's paths, or read another kernel's keys."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from sandbox import Sandbox, create_backend
from sandbox.backends.local import LocalBackend
from tests.conftest import require_backend, small_spec

PLANTED = """#!/bin/sh
echo ran > {marker}
exec /usr/bin/bwrap "$@"
"""


@pytest.fixture
def local(state_dir: Path) -> LocalBackend:
    require_backend("local")
    backend = create_backend("local", state_dir=state_dir)
    assert isinstance(backend, LocalBackend)
    return backend


def _host_path(sb: Sandbox, name: str) -> Path:
    path: Path = getattr(sb.dirs, name)  # type: ignore[attr-defined]
    return path


async def test_a_session_path_cannot_choose_the_host_bwrap(local: LocalBackend) -> None:
    """Session X plants `bwrap` in its workspace and opens it; session Y names that directory
    as its PATH. The host must still run its own bwrap, never X's file."""
    marker = Path(f"/tmp/cir-planted-{uuid.uuid4().hex}")
    async with await local.create(small_spec()) as x:
        ex = await x.execute(
            "import os\n"
            f"open('/workspace/bwrap', 'w').write({PLANTED.format(marker=marker)!r})\n"
            "os.chmod('/workspace/bwrap', 0o755); os.chmod('/workspace', 0o777)\n"
            "'planted'"
        )
        assert ex.text == "'planted'", ex.error
        x_workspace = _host_path(x, "workspace")
        assert os.access(x_workspace / "bwrap", os.X_OK)
        try:
            async with await local.create(small_spec(env={"PATH": str(x_workspace)})) as y:
                await y.restart()
                assert (await y.execute("1 + 1")).text == "2"
                # The session's PATH is still the kernel's own, inside.
                path = await y.execute("import os; os.environ['PATH']")
                assert path.text == repr(str(x_workspace))
            assert not marker.exists(), "the host ran a file a sandbox planted"
        finally:
            marker.unlink(missing_ok=True)


async def test_session_env_values_are_not_on_the_host_command_line(local: LocalBackend) -> None:
    secret = f"cir-secret-{uuid.uuid4().hex}"
    async with await local.create(small_spec(env={"API_TOKEN": secret})) as sb:
        assert (await sb.execute("import os; os.environ['API_TOKEN']")).text == repr(secret)
        seen = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if secret.encode() in (entry / "cmdline").read_bytes():
                        seen.append(entry.name)
                except OSError:
                    continue
        assert seen == [], "a session's variable shows in a host process's command line"


@pytest.mark.skipif(os.geteuid() != 0, reason="connection files change owner only as root")
async def test_connection_files_are_readable_by_the_kernel_alone(local: LocalBackend) -> None:
    async with await local.create(small_spec()) as sb:
        kernel_dir = _host_path(sb, "kernel")
        files = [p for p in kernel_dir.iterdir() if p.name.endswith(".json")]
        assert files
        kernel_uid = sb.driver._launcher.kernel_uid  # type: ignore[attr-defined]
        assert kernel_uid not in (None, 0)
        for conn in files:
            st = conn.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
            assert st.st_uid == kernel_uid
        # The kernel still reads it after a restart (a fresh file for the next kernel).
        await sb.restart()
        assert (await sb.execute("1 + 1")).text == "2"


@pytest.mark.skipif(os.geteuid() != 0, reason="the private mounts are made only as root")
async def test_mountinfo_names_no_state_dir_or_sandbox_id(
    local: LocalBackend, state_dir: Path
) -> None:
    async with await local.create(small_spec(host_tools=True)) as sb:
        ex = await sb.execute("open('/proc/self/mountinfo').read()")
        assert ex.ok, ex.error
        mountinfo = eval(ex.text or "")
        assert all(p in mountinfo for p in ("/run/kernel", "/workspace", "/run/host-tools"))
        for needle in (str(state_dir), state_dir.name, sb.id, "/local/"):
            assert needle not in mountinfo, (needle, mountinfo)


async def test_a_kernel_flooding_its_stdout_leaves_nothing_growing_on_the_host(
    local: LocalBackend, state_dir: Path
) -> None:
    async with await local.create(small_spec()) as sb:
        # ipykernel captures fds 1 and 2; the copies it keeps are the process's original ones.
        ex = await sb.execute(
            "import os, subprocess, sys, time\n"
            "out, err = sys.stdout._original_stdstream_copy, sys.stderr._original_stdstream_copy\n"
            "p = subprocess.Popen(['yes', 'flood-from-a-child'], stdout=err)\n"
            "end = time.monotonic() + 5\n"
            "while time.monotonic() < end:\n"
            "    os.write(out, b'x' * 65536)\n"
            "p.kill(); p.wait(); 'flooded'",
            timeout_s=120,
        )
        assert ex.text == "'flooded'", ex.error
        assert (await sb.execute("1 + 1")).text == "2"
        on_disk = sum(
            p.stat().st_size
            for p in (state_dir / "local").rglob("*")
            if p.is_file() and "workspace" not in p.parts
        )
        assert on_disk < 1 << 20, f"{on_disk} bytes of kernel output kept on the host"
        kernel = sb.driver._kernel  # type: ignore[attr-defined]
        diagnostics = kernel.process.diagnostics()
        assert 0 < len(diagnostics.encode()) <= 16 << 10
        assert "x" in diagnostics or "flood" in diagnostics


async def test_backend_uses_no_caller_path_for_host_binaries(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The service's own PATH does not choose bwrap either: it is found once, in fixed places."""
    require_backend("local")
    marker = tmp_path / "ran"
    planted = tmp_path / "bwrap"
    planted.write_text(PLANTED.format(marker=marker))
    planted.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    backend = create_backend("local", state_dir=state_dir)
    async with await backend.create(small_spec()) as sb:
        assert (await sb.execute("1 + 1")).text == "2"
    assert not marker.exists()
