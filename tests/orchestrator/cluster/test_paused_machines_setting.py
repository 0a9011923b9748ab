"""Where the ray backend keeps paused whole machines: inside the shared saved_states_dir, and
nowhere without one (its sessions' kernels are then saved instead, or not at all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import Settings
from sandbox.backends.ray_cluster.config import RayBackendConfig

pytestmark = pytest.mark.unit


def test_paused_machines_wait_beside_the_shared_saved_states(tmp_path: Path) -> None:
    settings = Settings(saved_states_dir=tmp_path)
    config = RayBackendConfig(**settings.ray_backend_config())  # type: ignore[arg-type]
    assert config.machine_images_dir == tmp_path / "code-interpreter-paused-machines"


def test_no_shared_saved_states_no_paused_machines() -> None:
    config = RayBackendConfig(**Settings().ray_backend_config())  # type: ignore[arg-type]
    assert config.machine_images_dir is None
