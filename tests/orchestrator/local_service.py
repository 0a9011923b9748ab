"""An in-process `Service` on the local backend (real kernels), started and closed around a
test; for tests of the service's parts and of a front driven in process."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from orchestrator.config import Settings
from orchestrator.service import Service
from tests.conftest import require_backend


@asynccontextmanager
async def local_service(
    owner: str, prefix: str, *, more_keys: Sequence[str] = (), **settings: Any
) -> AsyncIterator[Service]:
    """A started service whose keys are `owner` (and `more_keys`), with `settings` beside;
    its state dir (under /tmp, named `prefix`...) is removed after."""
    require_backend("local")
    root = Path(tempfile.mkdtemp(prefix=f"cir-{prefix}-", dir="/tmp"))
    root.chmod(0o711)  # sandboxes run as another uid: they must reach their state dir
    settings = Settings(
        backends=["local"],
        default_backend="local",
        state_dir=root / "state",
        orchestrator_id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        api_keys=[owner, *more_keys],
        **settings,
    )
    running = Service(settings)
    await running.start()
    try:
        yield running
    finally:
        await running.close()
        shutil.rmtree(root, ignore_errors=True)
