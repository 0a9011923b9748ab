"""Review of issue 17 (gVisor): scripts/ensure-docker-engine.sh's registration of runsc in
/etc/docker/daemon.json, run against a daemon.json of the test's own.

The script runs in private mount and pid namespaces: a directory of the test's is bound over
/etc/docker there (the host's file is never touched), and no dockerd is in sight, so the real
engine (which answers `docker info` through its socket) is never signalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_backend

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure-docker-engine.sh"


def run_script(etc_docker: Path) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("runsc") is None:
        pytest.skip("needs root, unshare and runsc")
    # An engine must answer: otherwise the script would start a dockerd of its own in there.
    require_backend("docker")
    inner = 'mount --bind "$1" /etc/docker && exec "$2"'
    namespaces = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork"]
    return subprocess.run(
        [*namespaces, "--mount-proc", "bash", "-c", inner, "_", str(etc_docker), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_operators_own_runsc_entry_is_kept(tmp_path: Path) -> None:
    """docs/gvisor.md: "keeping every other setting there", "Running it again changes nothing";
    it also names kvm as the faster platform. An operator who chose it must not have it
    reverted (and the engine reloaded) by every `make test`, `make image` or `make bench`."""
    own = {
        "path": shutil.which("runsc"),
        "runtimeArgs": ["--network=none", "--host-uds=all", "--platform=kvm"],
    }
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text(json.dumps({"log-level": "warn", "runtimes": {"runsc": own}}))
    done = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    config = json.loads(daemon_json.read_text())
    assert config["log-level"] == "warn"
    assert config["runtimes"]["runsc"] == own, config["runtimes"]["runsc"]


def test_a_private_daemon_json_stays_private(tmp_path: Path) -> None:
    """A daemon.json readable by root alone (it may hold registry or TLS settings) is not made
    world-readable by the rewrite."""
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text(json.dumps({"log-level": "warn"}))
    daemon_json.chmod(0o600)
    done = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "runsc" in json.loads(daemon_json.read_text())["runtimes"]  # it was rewritten
    assert oct(daemon_json.stat().st_mode & 0o777) == "0o600"


def test_a_malformed_daemon_json_is_told_by_name(tmp_path: Path) -> None:
    """A daemon.json that is not JSON: the script says which file and why, not a traceback."""
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text('{"log-level": "warn",}')
    done = run_script(tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert "daemon.json" in done.stderr, done.stderr
    assert daemon_json.read_text() == '{"log-level": "warn",}'
