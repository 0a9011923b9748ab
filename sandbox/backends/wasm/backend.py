"""The wasm backend (docs/wasm.md): each sandbox a Deno process running Pyodide
(sandbox.py), for code that needs no native library and must touch nothing: no network, no
processes, no host file, no daemon, and no namespaces either (it runs where none can be made).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, Field

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.spec import SandboxSpec
from sandbox import cgroups
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.wasm import distribution
from sandbox.backends.wasm.memory_snapshot import MemorySnapshots
from sandbox.backends.wasm.sandbox import WasmSandbox
from sandbox.cgroups import SandboxCgroup
from sandbox.run_to_end import finish_even_if_cancelled
from sandbox.state_dir import SessionDirs, default_state_dir

SNAPSHOTS_DIR = "wasm-snapshots"  # in the state directory, beside the sandboxes' own


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the wasm backend (sandbox/backends/registry.py)."""
    deno = Path(config.get("deno") or Path(sys.prefix) / "bin" / "deno")
    if not deno.is_file():
        return f"no Deno at {deno}: install the `languages` extra (the `deno` package)"
    try:
        distribution.check(Path(config.get("pyodide_dir") or distribution.configured_dir()))
    except distribution.PyodideMissing as exc:
        return str(exc)
    return None


class WasmBackendConfig(BaseModel):
    state_dir: Path = Field(default_factory=default_state_dir)
    pyodide_dir: Path = Field(
        default_factory=distribution.configured_dir,
        description="The Pyodide distribution the sandboxes run (`make install` fetches the "
        "pinned release; CODE_INTERPRETER_PYODIDE_DIR points elsewhere).",
    )
    wheels_dir: Path | None = Field(
        default=None,
        description="Pure-Python wheels the sandboxes may install (`await micropip.install`); "
        "read-only to them. None: only the standard library.",
    )
    deno: Path = Field(
        default_factory=lambda: Path(sys.prefix) / "bin" / "deno",
        description="The Deno binary; by default the one the `deno` package (PyPI) installs.",
    )
    use_cgroups: bool = Field(
        default=True,
        description="As root on cgroup v1, hold each sandbox's Deno process to the spec's CPU "
        "quota (`limits.cpus`), and its resident memory and threads, in a cgroup of its own "
        "(otherwise: no CPU cap, memory by RLIMIT_DATA alone).",
    )
    memory_snapshot: bool = Field(
        default=True,
        description="Start sandboxes from a memory snapshot of Pyodide loaded (taken once, "
        "kept in the state directory) rather than loading it cold each time.",
    )


class WasmBackend(Backend):
    name = "wasm"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        network_modes=("none",),
        host_tools=True,  # relayed by the service (tool_calls.py)
        processes=False,
        suspend=False,
        snapshot=False,
        shared_across_nodes=False,
        images=False,
        runtimes=False,
        warm_pool=True,
        labels_sandboxes=False,
        host_dirs=True,
        workspace_on_host=False,  # in the interpreter's memory
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(WasmBackendConfig(**config))

    def __init__(self, config: WasmBackendConfig | None = None) -> None:
        self.config = config or WasmBackendConfig()
        self._deno = str(self.config.deno)
        self._snapshots: MemorySnapshots | None = None

    async def create(self, spec: SandboxSpec | None = None) -> WasmSandbox:
        spec = spec or SandboxSpec()
        self.refuse_runtime(spec)
        pyodide = distribution.check(self.config.pyodide_dir)
        sandbox_id = secrets.token_hex(8)
        snapshot = await self._snapshot(pyodide.resolve())  # before anything is made to remove
        # Made whole even if this create is cancelled meanwhile, and then removed whole.
        making = asyncio.ensure_future(
            asyncio.to_thread(
                SessionDirs.create, self.config.state_dir, self.name, sandbox_id, root_mode=0o700
            )
        )
        try:
            dirs = await finish_even_if_cancelled(making)
        except OSError as exc:
            raise SandboxStartError(f"cannot make the sandbox's directory: {exc}") from None
        except asyncio.CancelledError:
            if not making.cancelled() and making.exception() is None:
                await finish_even_if_cancelled(asyncio.to_thread(making.result().remove))
            raise
        wheels = self.config.wheels_dir.resolve() if self.config.wheels_dir else None
        group = None
        if self.config.use_cgroups and cgroups.available():
            group = SandboxCgroup(sandbox_id, scale_parent=True)
        sandbox = WasmSandbox(
            sandbox_id, spec, dirs.root, pyodide.resolve(), self._deno, wheels, snapshot, group
        )
        try:
            await sandbox.start()
        except BaseException:  # undone whole, even if cancelled again meanwhile
            await finish_even_if_cancelled(self._undo(sandbox, dirs))
            raise
        return sandbox

    @staticmethod
    async def _undo(sandbox: WasmSandbox, dirs: SessionDirs) -> None:
        """What a start that failed (or was cancelled) made: its process, then its files."""
        try:
            await sandbox.close()
        finally:
            await asyncio.to_thread(shutil.rmtree, dirs.root, True)

    async def _snapshot(self, pyodide: Path) -> Path | None:
        if not self.config.memory_snapshot:
            return None
        if self._snapshots is None or self._snapshots.pyodide != pyodide:
            where = self.config.state_dir / SNAPSHOTS_DIR
            self._snapshots = MemorySnapshots(where, pyodide, self._deno)
        return await self._snapshots.path()

    async def cleanup_orphans(self) -> int:
        """The directories of sandboxes a service that died left (their Deno processes ended
        with it: each ends when its socket closes)."""
        state_dir = self.config.state_dir
        removed = await asyncio.to_thread(SessionDirs.remove_orphans, state_dir, self.name)
        # the groups of exactly those sandboxes, if any were made
        await asyncio.to_thread(cgroups.remove_groups_of, removed)
        return len(removed)
