"""The one small interface every backend implements.

A backend hands out sandboxes; a sandbox executes code (returning an Execution), moves files in
and out of its workspace, interrupts, restarts and closes. The interface sits at "execute code",
not at "give me a kernel socket", so a backend that runs its own interpreter (E2B) fits too.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

from code_interpreter_wire.errors import (
    ProcessesUnsupported,
    RootUnavailable,
    RuntimeUnavailable,
    SandboxError,
)
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.network_policy import NetworkMode
from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest
from code_interpreter_wire.results import DoneEvent, EventSink, Execution, FileInfo, OutputEvent
from code_interpreter_wire.spec import SandboxSpec
from sandbox.egress_channel import EgressChannel
from sandbox.host_channel import HostChannel
from sandbox.processes.handle import ProcessHandle
from sandbox.processes.managed import ManagedProcess
from sandbox.processes.spawned import Spawner
from sandbox.processes.table import ProcessTable

if TYPE_CHECKING:
    from sandbox.saved_report import SavedState

# What the sandboxed code sees as its working directory and workspace root.
WORKSPACE_IN_SANDBOX = "/workspace"
# The same workspace mounted a second time, where E2B's sandboxes keep the user's files (its
# home): clients built on E2B write there and expect to run there (`os.getcwd()`), so it is the
# same directory, not a link to it.
HOME_IN_SANDBOX = "/home/user"


class Sandbox(ABC):
    """One isolated, stateful interpreter with a workspace of files."""

    id: str
    backend: str
    spec: SandboxSpec
    # What runs it, where a backend has a choice: the OCI runtime of its containers (Docker:
    # `runc`, `runsc`...), the accelerator of its virtual machine (microvm: `kvm`, `tcg`).
    runtime: str | None = None
    # Where the host listens for this sandbox's tool calls; None: it has no channel.
    host_channel: HostChannel | None = None
    # Where the host's egress proxy listens for this sandbox; None: it has no network.
    egress_channel: EgressChannel | None = None

    @property
    def handle(self) -> str | None:
        """What another service process needs to reach this very sandbox (`Backend.attach`):
        None where the sandbox lives in this process only."""
        return None

    @property
    def languages(self) -> list[str]:
        """The languages its kernels speak (canonical names, code_interpreter_wire/languages.py),
        Python first."""
        return [PYTHON]

    @abstractmethod
    async def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        language: str = PYTHON,
    ) -> Execution:
        """Run code in the sandbox's kernel of `language` (started on first use); `on_event`
        sees each output as it happens. `LanguageUnavailable` if the sandbox has no such kernel."""

    async def stream(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        language: str = PYTHON,
    ) -> AsyncIterator[OutputEvent]:
        """Run code and yield its outputs as they happen; the last event is `done`."""
        queue: asyncio.Queue[OutputEvent | BaseException] = asyncio.Queue()

        async def run() -> None:
            try:
                execution = await self.execute(
                    code,
                    timeout_s=timeout_s,
                    env=env,
                    cwd=cwd,
                    on_event=queue.put,
                    language=language,
                )
                queue.put_nowait(DoneEvent(execution=execution))
            except Exception as exc:
                queue.put_nowait(exc)

        task = asyncio.ensure_future(run())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, DoneEvent):
                    return
        finally:
            if not task.done():  # the consumer left early: cancelling interrupts the code
                task.cancel()

    @abstractmethod
    async def set_env(self, env: dict[str, str]) -> None:
        """Add environment variables for the rest of the sandbox's life, restarts included."""

    async def set_workdir(self, path: str) -> None:
        """Make `path` (the workspace under either name, `SandboxSpec.workdir`) the kernels'
        working directory: the running ones move there, later ones start there."""
        self.spec.workdir = SandboxSpec.model_validate({"workdir": path}).workdir

    @abstractmethod
    async def interrupt(self) -> bool:
        """Stop the running executions, if any, in every language (they end as `cancelled`)."""

    @abstractmethod
    async def restart(self, language: str | None = None) -> None:
        """Replace the kernel of `language` (None: every kernel started) with a fresh one.
        Files in the workspace are kept."""

    @abstractmethod
    async def upload(self, path: str, data: bytes) -> FileInfo:
        """Write a file into the workspace (path relative to it); return what is there now."""

    @abstractmethod
    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        """Read a file of the workspace."""

    async def export_file(self, path: str, dest: Path, *, max_bytes: int) -> int:
        """Copy a workspace file to `dest` on this machine; its size. Backends with the
        workspace at hand copy it a chunk at a time; the others read it whole."""
        data = await self.download(path, max_bytes=max_bytes)
        await asyncio.to_thread(dest.write_bytes, data)
        return len(data)

    async def import_file(self, path: str, source: Path) -> FileInfo:
        """Write the file `source` of this machine into the workspace at `path`."""
        return await self.upload(path, await asyncio.to_thread(source.read_bytes))

    @abstractmethod
    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        """List a directory of the workspace."""

    @abstractmethod
    async def remove_file(self, path: str) -> None:
        """Delete a file or directory of the workspace."""

    @abstractmethod
    async def close(self) -> None:
        """Stop everything the sandbox runs and delete its workspace. Safe to call twice."""

    def weigh_cpu(self, *, background: bool) -> None:  # noqa: B027 - most cannot
        """Weigh the sandbox's CPU as background work (a warm pool's sandbox warming up
        yields the CPU to live sessions) or as a live session's again (handed over). Where
        the backend has no CPU weights of its own here, the weight stays as it is."""

    async def preload(self, code: str, *, timeout_s: float = 300.0) -> None:
        """Run `code` in Python's kernel before the sandbox is handed over, leaving no trace a
        session's code could see but the modules it imported (warm pools, templates)."""
        raise SandboxError(f"{type(self).__name__} cannot run code before it is handed over")

    async def suspend(self) -> str | None:
        """Pause the whole sandbox (memory, processes, files) where its engine can, and return
        the handle `Backend.wake` takes; the sandbox object is done with either way. None: this
        backend cannot (CRIU does not work here), so the caller saves the kernel's state
        itself (sandbox/saved_state.py) and closes the sandbox."""
        return None

    async def save_whole(self, into: Path, *, max_bytes: int) -> SavedState | None:
        """Save the whole sandbox (memory, every process, files) into `into` (a new directory,
        made here) and run on, where its engine can: what was kept, for `Backend.fork`. None:
        it cannot, so the caller saves the kernel's state instead (sandbox/saved_state.py).
        `StateTooLarge` if the save is over `max_bytes` (nothing of it is left)."""
        return None

    # --- processes beside the kernel: same boundary, same workspace (sandbox/processes/)
    _processes: ProcessTable | None = None

    def spawner(self) -> Spawner:
        """How this backend starts a process inside the sandbox."""
        raise ProcessesUnsupported(f"the {self.backend} backend cannot run processes")

    def shared_spawner(self) -> Spawner:
        """The spawner its processes share (its process table's, made once, closed with the
        sandbox), for what starts processes of its own beside them (the port relay): a new
        `spawner()` per start would leave a command server behind each time."""
        return self._process_table().spawner

    def _process_table(self) -> ProcessTable:
        if self._processes is None:
            self._processes = ProcessTable(
                self.spawner(), output_limit_chars=self.spec.output_limit_chars
            )
        return self._processes

    # Whether a process may run as root here (`ProcessRequest.user`): only where the sandbox's
    # wall does not depend on its processes being unprivileged (a gVisor machine), and the
    # operator has not turned it off.
    has_root: bool = False

    def _refuse_root(self, request: ProcessRequest) -> None:
        if request.user == "root" and not self.has_root:
            raise RootUnavailable(self._no_root_reason())

    def _no_root_reason(self) -> str:
        return (
            f"the {self.backend} backend's sandboxes have no root: every process runs as "
            "the sandbox's unprivileged user (its wall depends on it). Run it as the "
            "sandbox's user (`pip install` and `npm i -g` work so, into the workspace), or in a "
            "session on the gvisor backend, whose machines have root (user root, sudo)"
        )

    async def start_process(self, request: ProcessRequest) -> ProcessHandle:
        """Start a process in the sandbox; it runs until it ends, is killed, or the sandbox
        closes (or its kernel is replaced: processes live in the kernel's sandbox)."""
        self._refuse_root(request)
        return await self._process_table().start(request)

    async def run_command(self, request: ProcessRequest) -> CommandResult:
        """Start a process and wait for its end; cancelling kills it."""
        self._refuse_root(request)
        return await self._process_table().run(request)

    def process(self, pid: int) -> ManagedProcess:
        return self._process_table().get(pid)

    def list_processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        if self._processes is None:
            return []
        return self._processes.list(include_ended=include_ended)

    async def get_process(self, pid: int) -> ProcessHandle:
        """A process of the sandbox by its pid (`ProcessNotFound` if none): the one way the
        service reaches a process, wherever the sandbox runs (the ray backend's is remote)."""
        return self.process(pid)

    async def processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        """The sandbox's processes: those running, and the recently ended with `include_ended`."""
        return self.list_processes(include_ended=include_ended)

    async def _close_processes(self) -> None:
        if self._processes is not None:
            await self._processes.close()

    @property
    @abstractmethod
    def is_busy(self) -> bool:
        """Whether an execution is running or queued."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SavedSandboxUnusable(SandboxError):
    """A saved sandbox this host's engine cannot restore (its version, an image it lacks, a
    truncated save): nothing of the session was changed, and another host may restore it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendCapabilities:
    """What a backend's sandboxes can do, declared by the backend, so the service asks what it
    can do rather than which one it is."""

    # The network policy modes it enforces (code_interpreter_wire/network_policy.py).
    network_modes: tuple[NetworkMode, ...]
    # Its sandboxes can open a host-tool channel (SandboxSpec.host_tools).
    host_tools: bool
    # Commands and terminals beside the kernel (Sandbox.start_process, sandbox/processes/).
    processes: bool
    # The engine's own whole-sandbox pause: `Sandbox.suspend`, `Backend.wake`.
    suspend: bool
    # Saved states: the service saves a kernel's variables and the files
    # (sandbox/saved_state.py) and starts new sandboxes from them.
    snapshot: bool
    # Any replica of a cluster can attach to its sandboxes (`Backend.attach`).
    shared_across_nodes: bool
    # It runs the container image a spec names (SandboxSpec.image).
    images: bool
    # It can choose an OCI runtime (SandboxSpec.runtime, `Backend.runtimes`).
    runtimes: bool
    # The service's warm pool may keep its sandboxes ready: not where an idle one costs money,
    # expires on its own, or the backend keeps a pool of its own.
    warm_pool: bool
    # Its sandboxes live in an engine other services use too (a Docker engine, a cloud, a
    # cluster), told apart by its config's `orchestrator_id` when orphans are swept.
    labels_sandboxes: bool
    # Its sandboxes keep directories on this host, under `<state dir>/<its name>/`
    # (sandbox/state_dir.py): what a process that died left there is for the next to sweep.
    host_dirs: bool
    # Servers its code starts can be reached from outside (inbound ports): each connection a
    # relay process of the sandbox, started by its spawner (sandbox/port_relay.py).
    ports: bool = False
    # Its sandboxes have a root (`ProcessRequest.user`, sudo), its wall being another's: its
    # sandboxes say so too (`Sandbox.has_root`).
    root: bool = False
    # A sandbox's workspace is a directory on this host (under its `host_dirs`), which outlives
    # the process that made it: a service that restarts finds its sessions' files there. Not so
    # where the workspace is a disk inside a virtual machine, or in an interpreter's memory.
    workspace_on_host: bool = True
    # It mounts host directories into its sandboxes (SandboxSpec.mounts: volumes).
    mounts: bool = False
    # Its sandboxes' egress proxy is this service's, and they read the files put beside its
    # socket (/run/egress): the CA a secret's TLS is signed with (the credential vault).
    egress_files: bool = False

    @property
    def pause(self) -> bool:
        """A session on it can be paused and resumed: by the engine, or from a saved state."""
        return self.suspend or self.snapshot

    @property
    def egress_rules(self) -> bool:
        """Our egress proxy stands between it and the network, so allow lists and deny rules
        hold (a backend without it holds only all or nothing)."""
        return "allow_list" in self.network_modes


class Backend(ABC):
    """Creates sandboxes of one kind."""

    name: str
    capabilities: ClassVar[BackendCapabilities]

    @classmethod
    @abstractmethod
    def configured(cls, **config: Any) -> Self:
        """One made from its configuration's fields by name (sandbox/backends/registry.py)."""

    async def runtimes(self) -> list[str]:
        """The OCI runtimes a sandbox may ask for (SandboxSpec.runtime); none by default."""
        return []

    def refuse_runtime(self, spec: SandboxSpec) -> None:
        """Refuse a spec naming a runtime, on a backend that has no choice of runtime."""
        if spec.runtime is not None:
            raise RuntimeUnavailable(
                f"the {self.name} backend cannot choose an OCI runtime (asked: "
                f"{spec.runtime!r}); runtimes apply to the docker backend only"
            )

    @abstractmethod
    async def create(self, spec: SandboxSpec | None = None) -> Sandbox:
        """Start a sandbox and return it once its kernel answers."""

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        """The languages a sandbox of this spec would have, before one exists (for a tool's
        description)."""
        return [PYTHON]

    async def templates(self) -> list[str]:
        """The names of the templates (`code-interpreter template build`) whose images it can
        run: none where it runs no images."""
        return []

    async def attach(self, handle: str, spec: SandboxSpec) -> Sandbox:
        """The running sandbox `Sandbox.handle` named, made by another service process (a
        cluster's replicas share their sandboxes); `spec` is the one it was made with."""
        raise SandboxError(
            f"the {self.name} backend cannot attach to a sandbox another process made; its "
            "sandboxes live in the process that created them"
        )

    async def wake(self, handle: str, spec: SandboxSpec) -> Sandbox:
        """The sandbox `Sandbox.suspend` paused, running again as it was."""
        raise SandboxError(f"the {self.name} backend cannot wake a suspended sandbox")

    async def fork(self, saved: Path, spec: SandboxSpec) -> Sandbox:
        """A new sandbox restored from a whole-sandbox save (`Sandbox.save_whole`), as often as
        asked, each with secrets and random streams of its own; `saved` is left as it was."""
        raise SandboxError(f"the {self.name} backend cannot restore a whole-sandbox save")

    async def take_suspended(self, handle: str, into: Path) -> None:
        """Move the image of a sandbox `Sandbox.suspend` paused out of this backend, into
        `into` (a new directory on the same filesystem as its state dir), to be carried to
        another host and woken there (`wake_from`); the backend holds nothing of it after."""
        raise SandboxError(f"the {self.name} backend keeps no image of a suspended sandbox")

    async def wake_from(self, saved: Path, spec: SandboxSpec) -> Sandbox:
        """The sandbox whose image `take_suspended` gave (here or on another host), running
        again as it was: not re-keyed, since it goes on as the same sandbox. `saved` is left
        as it was."""
        raise SandboxError(f"the {self.name} backend cannot wake a carried suspended sandbox")

    async def woken(self, handle: str) -> None:  # noqa: B027 - most keep nothing after a wake
        """The session `wake(handle)` woke runs, and its record says so: what the wake kept of
        its image until then (to wake it again should the resume fail) may go."""

    async def suspend_left(self, sandbox_id: str) -> str | None:
        """Pause a sandbox an earlier process of this service left running, where the engine
        can: its handle for `wake`, or None (it is then cleared with the orphans)."""
        return None

    async def discard(self, handle: str) -> None:  # noqa: B027 - nothing to discard by default
        """Delete a suspended sandbox for good (its session was deleted while paused)."""

    async def cleanup_orphans(self) -> int:
        """Remove what an earlier crash of this orchestrator left behind; return how many."""
        return 0

    async def close(self) -> None:  # noqa: B027 - most backends hold nothing of their own
        """Release what the backend itself holds (not the sandboxes it handed out)."""
