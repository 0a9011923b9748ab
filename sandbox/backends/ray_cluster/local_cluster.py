"""A Ray cluster of our own on this one machine, every node on 127.0.0.1: for tests, benchmarks,
a laptop.

Why a launcher of its own rather than `ray start` / `ray stop`:
- loopback: each node is `python -m sandbox.backends.ray_cluster.loopback start --block`, since
  plain `ray start --node-ip-address=127.0.0.1` would advertise the machine's outward address;
- many clusters on one machine (other people's too): every node has a temp dir of its own
  under the cluster's directory, free ports (never fixed ones), and token authentication with
  a token of the cluster's own (never the user's ~/.ray/auth_token);
- stopping: `ray stop` stops every Ray process of the machine. Here a node is stopped by its own
  processes only, found in /proc: the session its `ray start --block` leads (each node runs in
  a session of its own), what names its temp dir, and everything under those. The cluster
  remembers every process of its own it saw, so whatever outlives a stop is reported
  (`Leftovers`), not silently left running.

`local_cluster(capacities)` is the whole life cycle: one node per capacity (the first is the
head), stopped and removed on the way out, `ClusterLeftovers` raised if anything outlived it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.backends.ray_cluster.loopback import LOOPBACK
from sandbox.backends.ray_cluster.names import NODE_BACKENDS

NODE_START_TIMEOUT_S = 180.0  # a node on a busy 2-core machine may take a minute to come up
STOP_GRACE_S = 20.0  # how long SIGTERM'd nodes get before what is left is SIGKILL'd
KILL_WAIT_S = 30.0  # how long SIGKILL'd processes get to be gone before they count as left
SESSION_RESOURCE = "cir_sessions"  # what a node offers sessions with (see backend.py)
# Every port a node would otherwise take at a fixed default: free ones, so clusters coexist.
_PORT_OPTIONS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)
_REPO = Path(__file__).resolve().parents[3]  # nodes import `sandbox` from this checkout
_STARTED = b"will now block"  # what `ray start --block` logs once its node runs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    return free_ports(1)[0]


def free_ports(count: int, *, besides: Sequence[int] = ()) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now, none of `besides`. All are held open
    until all are chosen: ports taken one at a time may repeat (the kernel hands a port just
    closed out again), and Ray refuses a node whose components share one."""
    held: list[socket.socket] = []  # the ones in `besides` too: so they are not handed out again
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind((LOOPBACK, 0))
            port: int = s.getsockname()[1]
            if port not in besides:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def new_token() -> str:
    """A Ray authentication token for one cluster."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class HostProcess:
    """What /proc says of a live process: enough to tell ours from others'."""

    parent: int
    session: int
    start_time: str  # with the pid, names the process (a pid may be reused)
    cmdline: bytes  # arguments separated by NUL

    @property
    def command(self) -> str:
        return self.cmdline.replace(b"\0", b" ").decode(errors="replace").strip()


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def host_processes() -> dict[int, HostProcess]:
    """Every live (not zombie) process of the host, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if fields is None or fields[0] == "Z":
            continue
        found[int(entry.name)] = HostProcess(int(fields[1]), int(fields[3]), fields[19], cmdline)
    return found


def _with_descendants(roots: set[int], table: Mapping[int, HostProcess]) -> set[int]:
    found = roots & set(table)
    grew = True
    while grew:
        grew = False
        for pid, process in table.items():
            if process.parent in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _names(directory: Path, cmdline: bytes) -> bool:
    """Whether a command line names `directory` or a path under it (not a sibling that merely
    starts alike: n1 is not n10)."""
    marker = str(directory).encode()
    padded = b"\0" + cmdline.replace(b"=", b"\0") + b"\0"
    return any(marker + end in padded for end in (b"/", b"\0"))


def is_ray_worker(cmdline: bytes) -> bool:
    """Whether a process is one of Ray's worker processes (an actor's or an idle one): those
    live as long as their node does, whoever used them."""
    return cmdline.startswith(b"ray::") or b"default_worker.py" in cmdline


@dataclass
class LocalNode:
    """One node: a `ray start --block` of ours, leading a session of its own."""

    name: str
    temp_dir: Path
    capacity: int  # sessions it offers (`cir_sessions`)
    head: bool
    process: subprocess.Popen[bytes]
    node_id: str = ""  # Ray's id, once it runs

    @property
    def log(self) -> Path:
        return self.temp_dir.with_suffix(".log")

    def pids(self, table: Mapping[int, HostProcess] | None = None) -> set[int]:
        """The node's live processes: its session, what names its temp dir, what runs under
        those (its actors' processes and the sandboxes they started)."""
        table = host_processes() if table is None else table
        roots = {
            pid
            for pid, process in table.items()
            if process.session == self.process.pid or _names(self.temp_dir, process.cmdline)
        }
        return _with_descendants(roots, table)


@dataclass(frozen=True)
class Leftovers:
    """What outlived its owner: processes (pid -> command line) and sandbox directories."""

    processes: dict[int, str] = field(default_factory=dict)
    sandbox_dirs: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.sandbox_dirs)

    def __str__(self) -> str:
        return f"processes {self.processes}, sandbox directories {self.sandbox_dirs}"


class ClusterLeftovers(RuntimeError):
    """A cluster left something behind: the machine is not as it found it."""

    def __init__(self, leftovers: Leftovers) -> None:
        super().__init__(f"the local Ray cluster left {leftovers}")
        self.leftovers = leftovers


class LocalCluster:
    """Nodes of ours on 127.0.0.1 under one directory (`root`), joined at `address`.

    Every process of it, and every driver joining it, runs with `env` (token authentication
    with this cluster's token, its nodes' sandbox state dir). `health_check_ms`, if given, is
    how often the head checks a raylet: a killed node is then found dead within a few periods.
    """

    def __init__(
        self,
        root: Path,
        *,
        token: str | None = None,
        port: int | None = None,
        health_check_ms: int | None = None,
    ) -> None:
        self.root = root
        self.token = token or new_token()
        self.port = port or free_port()
        self.health_check_ms = health_check_ms
        self.nodes: list[LocalNode] = []
        self._seen: dict[int, str] = {}  # pid of ours -> its start time

    @property
    def address(self) -> str:
        """The head's GCS address, what `ray.init(address=...)` and `--address` take."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def state_dir(self) -> Path:
        """Where the nodes' sandboxes live (`CIR_NODE_STATE_DIR`)."""
        return self.root / "state"

    @property
    def env(self) -> dict[str, str]:
        """What every node runs with, and what a driver joining the cluster needs."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "CIR_NODE_STATE_DIR": str(self.state_dir),
            "PYTHONPATH": str(_REPO),
        }

    def start_node(
        self,
        capacity: int = 0,
        *,
        head: bool | None = None,
        num_cpus: int = 1,
        resources: Mapping[str, float] | None = None,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
    ) -> LocalNode:
        """Start a node offering `capacity` sessions (and `resources` besides) and return once
        it runs. The first node is the head unless told; `head=True` later starts a head again
        on the same port (a restarted head). `env` is added to this node's environment only,
        `options` to its `ray start` (`--redis-password=...`, which Ray takes no other way)."""
        head = not self.nodes if head is None else head
        name = f"n{len(self.nodes)}"
        temp_dir = self.root / name  # short: Ray's socket paths must stay under 107 characters
        offered = dict(resources or {})
        if capacity:
            offered[SESSION_RESOURCE] = capacity
        command = [
            sys.executable, "-m", "sandbox.backends.ray_cluster.loopback", "start", "--block",
            f"--node-ip-address={LOOPBACK}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
            f"--num-cpus={num_cpus}", f"--resources={json.dumps(offered)}",
        ]  # fmt: skip
        # The dashboard's port last: only a head takes it.
        *ports, dashboard_port = free_ports(len(_PORT_OPTIONS) + 1, besides=(self.port,))
        command += [f"{option}={port}" for option, port in zip(_PORT_OPTIONS, ports, strict=True)]
        node_env = {**os.environ, **self.env, **(env or {})}
        if head:
            # No dashboard; Ray still runs its minimal one, on a port of its own here too.
            command += ["--head", f"--port={self.port}", "--include-dashboard=false"]
            command += [f"--dashboard-port={dashboard_port}"]
            if self.health_check_ms is not None:
                node_env["RAY_health_check_period_ms"] = str(self.health_check_ms)
                node_env["RAY_health_check_failure_threshold"] = "3"
        else:
            command += [f"--address={self.address}"]
        command += options
        self.root.mkdir(parents=True, exist_ok=True)
        with temp_dir.with_suffix(".log").open("ab") as log:
            process = subprocess.Popen(
                command,
                env=node_env,
                cwd=_REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the node's processes: this session's
            )
        node = LocalNode(name, temp_dir, capacity, head, process)
        self.nodes.append(node)  # before it runs: a failed start is stopped with the rest
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while _STARTED not in node.log.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                how = (
                    f"exited with {process.returncode}"
                    if process.returncode is not None
                    else f"not up after {NODE_START_TIMEOUT_S:g} s"
                )
                raise RuntimeError(
                    f"ray start of {name} {how}: {node.log.read_text()[-3000:]}"
                    f"{_daemon_errors(temp_dir)}"
                )
            time.sleep(0.2)
        node.node_id = self._node_id_of(node)
        self.remember()
        return node

    def _node_id_of(self, node: LocalNode) -> str:
        table = host_processes()
        for pid in node.pids(table):
            for arg in table[pid].cmdline.split(b"\0"):
                if arg.startswith(b"--node_id="):
                    return arg.split(b"=", 1)[1].decode()
        raise RuntimeError(f"no raylet found for {node.temp_dir}")

    def node(self, node_id: str) -> LocalNode:
        """The node of a Ray node id."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in this cluster")

    def own_pids(self, table: Mapping[int, HostProcess] | None = None) -> set[int]:
        """Every live process of ours: each node's, and what names the cluster's directory
        (a sandbox that left its actor's process tree still names its state dir)."""
        table = host_processes() if table is None else table
        sessions = {node.process.pid for node in self.nodes}
        roots = {
            pid
            for pid, process in table.items()
            if process.session in sessions or _names(self.root, process.cmdline)
        }
        return _with_descendants(roots, table)

    def remember(self) -> None:
        """Note every process of ours running now, to tell at the end whether any outlived
        the cluster (the nodes' daemons, the actors' workers, their sandboxes)."""
        table = host_processes()
        for pid in self.own_pids(table):
            self._seen.setdefault(pid, table[pid].start_time)

    def alive_pids(self) -> list[int]:
        """Processes of ours ever seen that still run (a reused pid is not ours)."""
        alive = []
        for pid, start in self._seen.items():
            now = _stat(pid)
            if now is not None and now[0] != "Z" and now[19] == start:
                alive.append(pid)
        return alive

    def kill_node(self, node: LocalNode | str) -> None:
        """Kill a node as a crash would (its machine or pod gone): every process of it frozen
        first (SIGSTOP), so none sees another die and answers for it (an actor reporting its
        sandbox's process killed, say), then SIGKILLed (again for any started meanwhile);
        return once none is left. Its actors' processes die with it, sandboxes included."""
        node = self.node(node) if isinstance(node, str) else node
        self.remember()
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        while pids := node.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        node.process.wait(timeout=KILL_WAIT_S)

    def stop_node(self, node: LocalNode | str) -> list[int]:
        """Stop a node gracefully (SIGTERM to its `ray start --block`, which stops its
        daemons), then SIGKILL what is left of it; what still runs after that."""
        node = self.node(node) if isinstance(node, str) else node
        self.remember()
        _terminate(node)
        return self._finish(node.pids, [node])

    def stop(self) -> list[int]:
        """Stop every node, then SIGKILL whatever of ours is left (Ray's helpers may linger;
        ours must not); what still runs after that."""
        self.remember()
        for node in reversed(self.nodes):
            _terminate(node)
        return self._finish(lambda: self.own_pids() | set(self.alive_pids()), self.nodes)

    def _finish(self, ours: Callable[[], set[int]], nodes: list[LocalNode]) -> list[int]:
        """Wait for `ours()` to be gone, SIGKILL what is not, wait again; the survivors."""
        _wait_until(lambda: not ours(), STOP_GRACE_S)
        for pid in ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: not ours(), KILL_WAIT_S)
        survivors = sorted(ours())
        for node in nodes:  # reap our `ray start --block` children
            if node.process.pid not in survivors:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(timeout=KILL_WAIT_S)
        return survivors

    def sandbox_dirs(self) -> list[str]:
        """Sandbox directories the nodes' backends hold now (none once every session ended)."""
        found = []
        for backend in NODE_BACKENDS:
            base = self.state_dir / backend
            if base.is_dir():
                found += [str(p) for p in base.iterdir()]
        return found

    def sandbox_processes(self) -> dict[int, str]:
        """Processes of ours that are neither a node's daemon nor one of Ray's workers: what
        actors started (sandboxes, kernels). None once every session ended, though the
        cluster runs on."""
        table = host_processes()
        workers = {pid for pid in self.own_pids(table) if is_ray_worker(table[pid].cmdline)}
        started = _with_descendants(workers, table) - workers
        escaped = {pid for pid, p in table.items() if _names(self.state_dir, p.cmdline)}
        return {
            pid: table[pid].command
            for pid in sorted(started | escaped)
            if not is_ray_worker(table[pid].cmdline)
        }


def _daemon_errors(temp_dir: Path) -> str:
    """The last lines of a node's daemons' error logs: why a start failed where `ray start`
    itself said little."""
    found = []
    for log in sorted(temp_dir.glob("session_2*/logs/*.err")):
        with contextlib.suppress(OSError):
            tail = log.read_text(errors="replace")[-600:].strip()
            if tail:
                found.append(f"\n--- {log.name}: {tail}")
    return "".join(found)[-3000:]


def _terminate(node: LocalNode) -> None:
    """SIGTERM a node's `ray start --block`: it stops the node's daemons in order (signalling
    the daemons too makes the head's linger). A node whose head went away may not stop so:
    what is left after the grace period is SIGKILL'd."""
    with contextlib.suppress(ProcessLookupError):
        node.process.send_signal(signal.SIGTERM)


def _wait_until(done: Callable[[], bool], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def local_cluster(
    capacities: Sequence[int],
    *,
    token: str | None = None,
    health_check_ms: int | None = None,
    prefix: str = "cir-lc-",
) -> Iterator[LocalCluster]:
    """A cluster of one node per capacity (the first is the head) in a fresh directory under
    /tmp, stopped and removed on the way out. A process or sandbox directory of it that
    outlived it raises `ClusterLeftovers` (after everything else was cleaned up)."""
    # Short (Ray's socket paths) and under /tmp; 0o711: sandbox uids pass through to the state.
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.chmod(0o711)
    cluster = LocalCluster(root, token=token, health_check_ms=health_check_ms)
    try:
        for capacity in capacities:
            cluster.start_node(capacity)
        yield cluster
    finally:
        survivors = cluster.stop()
        table = host_processes()
        left = Leftovers(
            {pid: table[pid].command if pid in table else "?" for pid in survivors},
            cluster.sandbox_dirs(),
        )
        shutil.rmtree(root, ignore_errors=True)
    if left:
        raise ClusterLeftovers(left)
