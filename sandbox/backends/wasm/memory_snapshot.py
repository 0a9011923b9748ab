"""The memory snapshot wasm sandboxes start from: Pyodide loaded, as a sandbox's worker loads it,
before any session's code, and its memory written to a file (snapshot.mjs). A worker restored
from it starts in a fraction of a cold start's time (`make bench`).

Taken once per Pyodide and Deno (the file's name is a digest of both and of the script), by a
Deno process that may read Pyodide's files and write the snapshot's temporary path and nothing
else, and kept in the service's state directory, readable to the sandboxes and written by no
one else. Nothing of a session is ever in it, and what every session restored from it would
share is taken back: each draws its own random state as it starts (inside_pyodide.py;
`os.urandom` is the host's). What it cannot renew is the interpreter's string hash seed, the
same in every session from one snapshot (it keys no secret of ours; docs/wasm.md). A snapshot
that cannot be taken leaves sandboxes to start cold, said in the log, and is tried again after
`RETRY_S`; one that will not load starts that sandbox cold (worker.mjs) and is deleted, to be
taken again. While one is taken, sandboxes wait for it (a take is 2-5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import time
from pathlib import Path

from sandbox.backends.wasm import distribution
from sandbox.backends.wasm.sandbox import DENO_RUN

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "snapshot.mjs"
TAKE_S = 120.0  # a cold load is 2-5 s; a loaded machine may take much longer
RETRY_S = 300.0


class MemorySnapshots:
    def __init__(self, directory: Path, pyodide: Path, deno: str) -> None:
        self.directory = directory
        self.pyodide = pyodide
        self.deno = deno
        self._lock = asyncio.Lock()
        self._failed_at: float | None = None

    def _name(self) -> str:
        """The file's name: a digest of what the snapshot depends on."""
        digest = hashlib.sha256(distribution.VERSION.encode())
        for path in (self.pyodide / "pyodide.asm.wasm", self.pyodide / "python_stdlib.zip"):
            st = path.stat()
            digest.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
        st = Path(self.deno).stat()
        digest.update(f"{self.deno}:{st.st_size}:{st.st_mtime_ns}".encode())
        digest.update(SCRIPT.read_bytes())
        return f"pyodide-{digest.hexdigest()[:32]}.bin"

    async def path(self) -> Path | None:
        """The snapshot's path, taken now if it is not yet; None: start cold."""
        try:
            target = self.directory / await asyncio.to_thread(self._name)
        except OSError as exc:
            log.warning("wasm sandboxes start cold: %s", exc)
            return None
        if target.is_file():
            return target
        async with self._lock:
            if target.is_file():
                return target
            if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_S:
                return None
            try:
                await self._take(target)
            except (OSError, RuntimeError, TimeoutError) as exc:
                self._failed_at = time.monotonic()
                log.warning("wasm sandboxes start cold: no memory snapshot was taken: %s", exc)
                return None
            self._failed_at = None
            return target

    async def _take(self, target: Path) -> None:
        await asyncio.to_thread(self.directory.mkdir, mode=0o700, parents=True, exist_ok=True)
        partial = self.directory / f".{target.name}.{secrets.token_hex(4)}.partial"
        process = await asyncio.create_subprocess_exec(
            self.deno,
            *DENO_RUN,
            f"--allow-read={self.pyodide}",
            f"--allow-write={partial}",
            str(SCRIPT),
            str(self.pyodide),
            str(partial),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Its caches where none can be made (under a plain file): it leaves nothing behind.
            env={"NO_COLOR": "1", "HOME": str(self.directory), "DENO_DIR": str(SCRIPT / "deno")},
        )
        try:
            async with asyncio.timeout(TAKE_S):
                said, _ = await process.communicate()
            if process.returncode != 0:
                text = said.decode(errors="replace").strip()[-2000:]
                raise RuntimeError(f"Deno ended with {process.returncode}: {text}")
            await asyncio.to_thread(os.replace, partial, target)
            await asyncio.to_thread(self._forget_others, target)
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            partial.unlink(missing_ok=True)

    def _forget_others(self, kept: Path) -> None:
        """Snapshots of an earlier Pyodide or Deno (no sandbox will start from them again), and
        what a take cut short left (one older than a take can last)."""
        for other in self.directory.glob("pyodide-*.bin"):
            if other != kept:
                other.unlink(missing_ok=True)
        for partial in self.directory.glob(".pyodide-*.partial"):
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > TAKE_S:
                    partial.unlink()
