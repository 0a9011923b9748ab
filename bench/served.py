"""A `code-interpreter serve` of our own for a benchmark: started on a free port of 127.0.0.1 with
a state dir of its own, waited for, and stopped (its state removed) when done."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

API_KEY = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def served(**settings: str) -> AsyncIterator[str]:
    """The service's URL while it runs; `settings` become CODE_INTERPRETER_* variables."""
    root = Path(tempfile.mkdtemp(prefix="cir-bench-", dir="/tmp"))
    root.chmod(0o711)
    port = free_port()
    env = {
        **os.environ,
        "CODE_INTERPRETER_API_KEYS": API_KEY,
        "CODE_INTERPRETER_STATE_DIR": str(root / "state"),
        **{f"CODE_INTERPRETER_{name.upper()}": value for name, value in settings.items()},
    }
    server = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "orchestrator", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as probe:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        await asyncio.wait_for(server.wait(), 60)
        shutil.rmtree(root, ignore_errors=True)
