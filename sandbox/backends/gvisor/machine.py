"""One gVisor machine: a runsc container driven directly (no engine), its OCI bundle, its image's
root filesystem, and its checkpoint and restore.

Why raw runsc (docs/gvisor.md): its checkpoint and restore are gVisor's own and need no CRIU,
while Docker's `checkpoint` is CRIU-bound and cannot restore into a new container. The machine's
first process is our agent (machine_agent.py), given pipes as its stdio: a restore hands it new
ones and it goes on, so the host loses nothing but the streams it dropped before.

The root filesystem is the image's, exported once per image id and shared read-only by every
machine of it; each machine sees it through an overlay in its own memory (`--overlay2=root:
memory`: counted in its memory limit, saved with it, gone with it), so its root may install
packages (`apt-get`, `npm -g`) without a byte reaching the shared export. Its other writes go to
its tmpfs mounts (/tmp, /run: saved with it) or to its workspace (a bind of the session's host
directory).

Root inside (processes asked as `root`, `sudo`): gVisor is the wall, not the processes' lack of
rights. Root holds the few capabilities installing takes, inside gVisor's own kernel only; no
host device, network or socket is reachable (below), its files in the workspace stay under the
session's directory, which no other host user can enter (mode 0700), and the host counts the
machine's tasks whatever uids they take (a pids cgroup).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

from code_interpreter_wire.errors import (
    BackendUnavailable,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)
from code_interpreter_wire.spec import DirectoryMount, ResourceLimits
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX, SavedSandboxUnusable
from sandbox.backends.docker_launcher import gvisor_host_pids
from sandbox.backends.gvisor.agent_channel import (
    AcceptHandler,
    AgentChannel,
    AgentError,
    save_and_go_on,
)
from sandbox.egress_channel import FORWARDER_FILE, FORWARDER_IN_SANDBOX
from sandbox.inside_kernel import (
    machine_agent,
    machine_children,
    machine_files,
    machine_root,
    machine_sudo,
    machine_wire,
)
from sandbox.kernel.command import KERNEL_START_FILES
from sandbox.kernel.programs import SUPERVISOR_FILE, SUPERVISOR_IN_SANDBOX
from sandbox.program_version import program_version

log = logging.getLogger(__name__)

AGENT_IN_SANDBOX = "/opt/code-interpreter/machine_agent.py"
# The agent and the modules it imports from its own directory, bound read-only beside it.
AGENT_FILES = tuple(
    (Path(host), str(PurePosixPath(AGENT_IN_SANDBOX).with_name(Path(host).name)))
    for host in (
        machine_agent.__file__,
        machine_wire.__file__,
        machine_children.__file__,
        machine_files.__file__,
        machine_root.__file__,
    )
)
# sudo in a machine: asks the agent (machine_root.py), bound over the image's own `sudo`.
SUDO_FILE = Path(machine_sudo.__file__)
SUDO_IN_SANDBOX = "/usr/local/bin/sudo"
# The rights of root inside gVisor (the agent's, and a process asked as root or through sudo):
# what installing packages takes (dpkg sets owners and modes, apt drops to its own user), no
# more: each right more is more of gVisor's kernel to get wrong. A process of the sandbox's
# user has none of them.
_ROOT_CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
]
# --network=none: only a loopback in gVisor's own netstack. --host-uds=none: no host socket can
# be reached or bound from inside (either would also make the machine impossible to save).
# --overlay2=root:memory: the shared root filesystem under a writable layer in the machine's
# own memory.
RUNSC_FLAGS = (
    "--platform=ptrace",
    "--network=none",
    "--host-uds=none",
    "--overlay2=root:memory",
)
RUNSC_TIMEOUT_S = 120.0
CGROUP_PARENT = "/code-interpreter-gvisor"
_REASON_CHARS = 2000


class MachineError(SandboxError):
    """runsc refused or failed (the message holds its verb and reason)."""


class RestoreFailed(MachineError):
    """A machine saved while it ran could not be restored to run on: the image is good, the
    machine is gone (the next call starts a new one)."""


class ImageUnusable(MachineError, SavedSandboxUnusable):
    """A saved machine image cannot be restored (missing, truncated, corrupt, or from another
    gVisor version): nothing of the session was changed."""


def runsc_program() -> str:
    found = shutil.which("runsc")
    if found is None:
        raise BackendUnavailable(
            "gVisor's runsc is not installed: `apt-get install runsc` (docs/gvisor.md)"
        )
    if os.geteuid() != 0:
        raise BackendUnavailable("the gvisor backend drives runsc, which needs root here")
    return found


async def host_runsc_version() -> str:
    """The version of the runsc this host runs machines with."""
    return await program_version(runsc_program())


class Machine:
    """One runsc container and the channel to its agent."""

    def __init__(
        self,
        program: str,
        root: Path,
        container_id: str,
        bundle: Path,
        *,
        root_allowed: bool = True,
    ) -> None:
        self.program = program
        self.root_allowed = root_allowed  # told to its agent at every hello, restores too
        self.root = root
        self.id = container_id
        self.bundle = bundle
        self.channel: AgentChannel | None = None
        self.restarts = 0  # times it ended on its own and was started again
        self._closed = False
        self._on_accept: AcceptHandler | None = None
        self._starting = asyncio.Lock()
        self._drainers: set[asyncio.Future[None]] = set()
        self.stderr_tail = b""  # the last the machine wrote to its stderr (the agent's)

    async def _runsc(self, *args: str, fds: tuple[int, int] | None = None) -> None:
        """One runsc command; MachineError with runsc's own reason if it fails.

        Its stderr (and its log: `--log` would otherwise go to stdout, which is the agent's
        channel for `run` and `restore`) is a pipe read here. A started machine inherits it,
        so after the command it is read on by `_drain_stderr` for the machine's life, keeping
        only the last of it: nothing a machine writes there is held unbounded."""
        err_r, err_w = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                self.program,
                f"--root={self.root}",
                "--log=/proc/self/fd/2",
                *RUNSC_FLAGS,
                *args,
                stdin=fds[0] if fds else asyncio.subprocess.DEVNULL,
                stdout=fds[1] if fds else asyncio.subprocess.DEVNULL,
                stderr=err_w,
            )
        finally:
            os.close(err_w)
        os.set_blocking(err_r, False)
        try:
            try:
                code = await asyncio.wait_for(process.wait(), RUNSC_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                raise MachineError(
                    f"runsc {args[0]} did not end in {RUNSC_TIMEOUT_S:.0f} s"
                ) from None
            text = _read_available(err_r).decode(errors="replace")
        except BaseException:
            os.close(err_r)
            raise
        if fds is None:
            os.close(err_r)
        else:  # the machine holds its write end now
            drainer = asyncio.ensure_future(self._drain_stderr(err_r))
            self._drainers.add(drainer)
            drainer.add_done_callback(self._drainers.discard)
        if code != 0:
            raise MachineError(f"runsc {args[0]} failed (exit {code}): {_reason(text)}")

    async def _drain_stderr(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    return
                self.stderr_tail = (self.stderr_tail + data)[-_REASON_CHARS:]
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    async def start(self, on_accept: AcceptHandler, *, image: Path | None = None) -> AgentChannel:
        """Run the machine (or restore it from `image`); its agent's channel."""
        self._on_accept = on_accept
        from_agent_r, to_agent_w = await self._launch(image)
        self.channel = await AgentChannel.over_pipes(from_agent_r, to_agent_w, on_accept)
        self.channel.root_allowed = self.root_allowed
        return self.channel

    async def _launch(self, image: Path | None) -> tuple[int, int]:
        """`runsc run` (or `restore` from `image`), detached, its stdio our pipes: our ends."""
        to_agent_r, to_agent_w = os.pipe()
        from_agent_r, from_agent_w = os.pipe()
        try:
            if image is None:
                await self._runsc(
                    "run",
                    "-bundle",
                    str(self.bundle),
                    "-detach",
                    self.id,
                    fds=(to_agent_r, from_agent_w),
                )
            else:
                await self._runsc(
                    "restore",
                    f"--image-path={image}",
                    "-bundle",
                    str(self.bundle),
                    "-detach",
                    self.id,
                    fds=(to_agent_r, from_agent_w),
                )
        except BaseException:
            for fd in (to_agent_w, from_agent_r):
                os.close(fd)
            raise
        finally:
            os.close(to_agent_r)
            os.close(from_agent_w)
        return from_agent_r, to_agent_w

    async def running(self) -> AgentChannel:
        """Its agent's channel. A machine that ended on its own (its memory limit, most often:
        gVisor ends whole) is started again first, fresh: the session goes on in a new machine
        with its workspace, as it goes on in a new kernel after a kernel's crash."""
        channel = self.channel
        if channel is not None and not channel.closed.done() and not channel.detached:
            return channel
        async with self._starting:  # after a save that goes on (`checkpoint_and_go_on`)
            channel = self.channel
            if channel is not None and not channel.closed.done() and not channel.detached:
                return channel
            if self._closed or channel is None or channel.detached or self._on_accept is None:
                raise SandboxClosed("the sandbox's machine is closed")
            log.warning("machine %s ended on its own; starting a new one", self.id)
            with contextlib.suppress(MachineError):
                await self._runsc("delete", "-force", self.id)
            channel = await self.start(self._on_accept)
            await channel.hello()
            self.restarts += 1
            return channel

    async def checkpoint(self, image: Path) -> None:
        """Save the whole machine to `image` (a new directory); the machine stops. If runsc
        fails, the machine may run on, its agent quiet until `AgentChannel.reattach`."""
        assert self.channel is not None
        await self.channel.detach()
        os.mkdir(image, 0o700)
        await self._runsc("checkpoint", f"--image-path={image}", self.id)
        # Stopped: the container's delete (a second or so) is left to `destroy`, its close's.

    async def checkpoint_and_go_on(
        self, image: Path, while_stopped: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Save the whole machine to `image` (a new directory) and run on, restored from it at
        once: the same agent, channel and children (this gVisor's `checkpoint --leave-running`
        never returns). `while_stopped` runs between the two (the files are still then); its
        failure is raised once the machine runs again. A failed checkpoint is the caller's to
        `reattach` after; a failed restore leaves the channel closed, so `running` starts a
        new machine."""
        channel = self.channel
        assert channel is not None
        os.mkdir(image, 0o700)

        await save_and_go_on(
            channel,
            self._starting,
            lambda: self._checkpoint_and_restore(channel, image, while_stopped),
        )

    async def _checkpoint_and_restore(
        self,
        channel: AgentChannel,
        image: Path,
        while_stopped: Callable[[], Awaitable[None]] | None,
    ) -> None:
        await channel.detach()
        await self._runsc("checkpoint", f"--image-path={image}", self.id)
        failure: Exception | None = None
        if while_stopped is not None:
            try:
                await while_stopped()
            except Exception as exc:
                failure = exc
        for attempt in (1, 2):  # the image is good: a restore that fails is tried once more
            try:
                with contextlib.suppress(MachineError):
                    await self._runsc("delete", "-force", self.id)
                await self._rebind(channel, image)
                await channel.reattach()
                break
            except (MachineError, AgentError) as exc:
                log.warning(
                    "machine %s: restore %d after its save failed: %s", self.id, attempt, exc
                )
                if attempt == 2:
                    await channel.close()
                    channel.not_detached()  # ended: the next call starts anew
                    raise RestoreFailed(f"the machine was saved, then not restored: {exc}") from exc
        if failure is not None:
            raise failure

    async def _rebind(self, channel: AgentChannel, image: Path) -> None:
        from_agent_r, to_agent_w = await self._launch(image)
        try:
            await channel.rebind(from_agent_r, to_agent_w)
        except BaseException:
            for fd in (from_agent_r, to_agent_w):
                with contextlib.suppress(OSError):  # unless the channel took it already
                    os.close(fd)
            raise

    @property
    def cgroup(self) -> str:
        """Its host cgroup (each controller's hierarchy), where runsc puts its limits."""
        return f"{CGROUP_PARENT}/{self.id}"

    def hit_memory_limit(self) -> bool | None:
        """Whether the kernel's OOM killer acted in its memory cgroup (cgroup v1's
        `oom_kill` count): what ends a whole machine at its limit. None where unreadable."""
        try:
            control = Path(f"/sys/fs/cgroup/memory{self.cgroup}/memory.oom_control").read_text()
        except OSError:
            return None
        for line in control.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value or 0) > 0
        return None

    async def destroy(self) -> None:
        """Kill and delete the container; safe to call twice."""
        self._closed = True
        async with self._starting:  # not while a new machine starts: it is deleted after
            if self.channel is not None:
                await self.channel.close()
            with contextlib.suppress(MachineError):
                await self._runsc("delete", "-force", self.id)
        for drainer in list(self._drainers):
            drainer.cancel()


def _read_available(fd: int) -> bytes:
    """What a non-blocking pipe holds now, at most 1 MiB (the last of it kept)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data = (data + chunk)[-(1 << 20) :]


def _reason(log_text: str) -> str:
    """runsc's own words: its first lines that say what went wrong (a Go trace follows them)."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    wanted = [line for line in lines if "error" in line.lower() or "panic" in line.lower()]
    return " | ".join((wanted or lines)[:4])[:_REASON_CHARS] or "no reason given"


def oci_config(
    *,
    rootfs: Path,
    dirs_etc: Path,
    workspace: Path,
    limits: ResourceLimits,
    cgroup: str | None,
    read_only: dict[str, Path] | None = None,
    volumes: Sequence[DirectoryMount] = (),
) -> dict[str, Any]:
    """The machine's OCI config: its agent as root (with root's rights inside gVisor), the
    root filesystem under the machine's own overlay, tmpfs /tmp and /run (saved with the
    machine), the workspace bound twice, our programs bound read-only, `read_only`'s host
    directories at their paths inside (the channels' files), `volumes` at theirs (read-only
    as each says), and the sandbox's limits."""
    memory = limits.memory_mb << 20

    def bind(source: Path, target: str, *, ro: bool) -> dict[str, Any]:
        return {
            "destination": target,
            "type": "bind",
            "source": str(source),
            "options": ["rbind", "ro" if ro else "rw"],
        }

    rlimits = [
        {"type": "RLIMIT_NOFILE", "hard": limits.open_files, "soft": limits.open_files},
        {"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids},
        {
            "type": "RLIMIT_FSIZE",
            "hard": limits.file_size_mb << 20,
            "soft": limits.file_size_mb << 20,
        },
        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
    ]
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/opt/kernel/bin/python", "-I", "-S", AGENT_IN_SANDBOX],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
            "capabilities": {k: _ROOT_CAPABILITIES for k in ("bounding", "effective", "permitted")},
            # sudo's setuid bit works (inside gVisor: see the module's docstring).
            "noNewPrivileges": False,
            "rlimits": rlimits,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["mode=1777", "size=64m"],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [f"size={limits.tmp_size_mb}m", "mode=1777"],
            },
            {
                "destination": "/run",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["size=16m", "mode=755"],
            },
            *(bind(host, inside, ro=True) for host, inside in AGENT_FILES),
            bind(SUPERVISOR_FILE, SUPERVISOR_IN_SANDBOX, ro=True),
            # This service's own start-up files, so a kernel does what this host expects of it.
            *(bind(host, inside, ro=True) for host, inside in KERNEL_START_FILES),
            bind(FORWARDER_FILE, FORWARDER_IN_SANDBOX, ro=True),
            bind(SUDO_FILE, SUDO_IN_SANDBOX, ro=True),
            bind(dirs_etc / "passwd", "/etc/passwd", ro=True),
            bind(dirs_etc / "group", "/etc/group", ro=True),
            bind(workspace, WORKSPACE_IN_SANDBOX, ro=False),
            bind(workspace, HOME_IN_SANDBOX, ro=False),
            *(bind(source, target, ro=True) for target, source in (read_only or {}).items()),
            *(bind(Path(m.source), m.path, ro=m.read_only) for m in volumes),
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "resources": {
                "memory": {"limit": memory, "swap": memory},
                "cpu": {"quota": int(limits.cpus * 100_000), "period": 100_000},
                # RLIMIT_NPROC counts per uid, and root may take any uid: the host's own count
                # of the machine's tasks holds whatever uids its processes take.
                "pids": {"limit": gvisor_host_pids(limits.pids)},
            },
        },
    }
    if cgroup is not None:
        config["linux"]["cgroupsPath"] = cgroup
    return config


def write_bundle(bundle: Path, config: dict[str, Any]) -> None:
    bundle.mkdir(mode=0o700, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))


def unpack_rootfs(client: Any, image: str, store: Path) -> Path:
    """The image's root filesystem, exported once per image id into `store/<id>/rootfs` and
    shared read-only; made in a temporary directory and renamed, under a lock, so a half-made
    one is never used (blocking: run it on a thread)."""
    try:
        image_id = str(client.images.get(image).id).removeprefix("sha256:")[:32]
    except Exception as exc:
        raise SandboxStartError(
            f"the kernel image {image!r} is not on the Docker engine (`make image`): {exc}"
        ) from None
    # 0700: the export keeps the image's setuid programs (sudo, su, mount): no other host user
    # may reach them (runsc, as root, needs no more).
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    store.chmod(0o700)
    done = store / image_id / "rootfs"
    if done.is_dir():
        return done
    with (store / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_dir():
            return done
        work = store / f".{image_id}.partial"
        shutil.rmtree(work, ignore_errors=True)
        (work / "rootfs").mkdir(parents=True)
        container = client.containers.create(image, command=["true"])
        try:
            stream = cast(IO[bytes], _ChunkReader(container.export(chunk_size=1 << 20)))
            dest = str(work / "rootfs")
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    if _safe_member(member, dest) is not None:
                        tar.extract(member, dest, set_attrs=True, numeric_owner=True)
        finally:
            container.remove(force=True)
        (work / "rootfs").chmod(0o755)
        work.rename(store / image_id)
    return done


def _safe_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """The image's files as they are (owners, modes, links), devices skipped; but nothing is
    written outside `dest`, through a link the image holds or by its name."""
    if member.isdev():
        return None
    name = member.name
    if name.startswith("/") or ".." in name.split("/"):
        raise tarfile.TarError(f"an image member named {name!r}")
    root = os.path.realpath(dest)
    parent = os.path.realpath(os.path.join(root, os.path.dirname(name)))
    if parent != root and not parent.startswith(root + os.sep):
        raise tarfile.TarError(f"an image member {name!r} behind a link out of the image")
    target = os.path.join(parent, os.path.basename(name))
    if os.path.islink(target) and not member.isdir():  # never written through a link
        os.unlink(target)
    elif os.path.islink(target):
        raise tarfile.TarError(f"an image directory {name!r} where a link is")
    if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
        raise tarfile.TarError(f"an image hard link to {member.linkname!r}")
    return member


class _ChunkReader:
    """A file-like view of the engine's export stream: never more than a chunk held."""

    def __init__(self, chunks: Any) -> None:
        self._chunks = iter(chunks)
        self._buffer = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buffer += chunk
        if size < 0:
            size = len(self._buffer)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data
