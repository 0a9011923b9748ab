"""What a caller asks of a sandbox: resource limits, environment and execution defaults."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol, TypeVar

from pydantic import AfterValidator, BaseModel, Field

from code_interpreter_wire.network_policy import NO_NETWORK, NetworkPolicy


@dataclass(frozen=True)
class Ceiling:
    """The most a session may ask for of a limit. Metadata only: pydantic does not enforce it,
    so an operator's defaults and in-process callers may go past it; the service holds each
    session's request to it."""

    value: float


class ResourceLimits(BaseModel):
    """Per-sandbox limits. Defaults are safe for untrusted code on a small machine; each field's
    `Ceiling` is the most a session's request may ask for.

    Which backend enforces what is spelled out in the README ("Limits, honestly").
    """

    memory_mb: Annotated[int, Ceiling(16384)] = Field(
        2048, ge=64, description="Memory for the whole sandbox, in MiB."
    )
    cpus: Annotated[float, Ceiling(4)] = Field(
        1.0, gt=0, description="CPU quota in cores (Docker)."
    )
    pids: Annotated[int, Ceiling(4096)] = Field(
        256, ge=16, description="Most processes and threads at once."
    )
    file_size_mb: Annotated[int, Ceiling(8192)] = Field(
        1024, ge=1, description="Largest single file the code may write."
    )
    open_files: Annotated[int, Ceiling(65536)] = Field(
        1024, ge=64, description="Most open file descriptors per process."
    )
    tmp_size_mb: Annotated[int, Ceiling(8192)] = Field(
        512, ge=1, description="Size of the private /tmp."
    )
    workspace_size_mb: Annotated[int, Ceiling(16384)] = Field(
        1024, ge=1, description="Size of the workspace (a tmpfs when the orchestrator is root)."
    )


def limit_ceilings() -> dict[str, float]:
    """Each limit's ceiling, read from its field's `Ceiling`."""
    return {
        name: next(m.value for m in info.metadata if isinstance(m, Ceiling))
        for name, info in ResourceLimits.model_fields.items()
    }


def check_environment(env: dict[str, str]) -> dict[str, str]:
    """Refuse what no environment can hold: a NUL anywhere (it would end the string, or an
    argument of a launcher), an empty name, or `=` in a name."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"{name!r} is not an environment variable name")
        if "\0" in value:
            raise ValueError(f"the value of {name} holds a NUL character")
    return env


# Where a directory of the host may be mounted in a sandbox: below these, never over the
# system's own directories (/usr, /etc, /proc, /tmp, /run...), nor in the workspace, whose
# files the service reaches on the host (a mount there would hide from it what it shows).
MOUNT_ROOTS = ("/mnt", "/data")
MAX_MOUNTS = 8
_MOUNT_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_mount_path(path: str) -> str:
    """A mount point as the sandbox names it: absolute, plain, below one of MOUNT_ROOTS."""
    parts = path.split("/")
    below = [root for root in MOUNT_ROOTS if path.startswith(root + "/")]
    if (
        not below
        or len(path) > 256
        or len(parts) > 10
        or not all(_MOUNT_PART.match(p) for p in path[len(below[0]) + 1 :].split("/"))
    ):
        raise ValueError(
            f"{path!r} is not a mount point a sandbox may have: an absolute path below "
            f"{' or '.join(MOUNT_ROOTS)} (e.g. /mnt/data), each name letters, digits, '.', '_' "
            "or '-', without '..' or a trailing '/'"
        )
    return path


class DirectoryMount(BaseModel):
    """A directory of the host seen in the sandbox at `path` (a volume: orchestrator/volumes/).
    Backends that can mount declare it (`BackendCapabilities.mounts`)."""

    source: str = Field(description="The host's directory (the service's to choose).")
    path: Annotated[str, AfterValidator(check_mount_path)]
    read_only: bool = False


class _Placed(Protocol):
    path: str


_P = TypeVar("_P", bound=_Placed)


def mounts_apart(mounts: list[_P]) -> list[_P]:
    """No two mounts at one place, nor one inside another (which would hide it)."""
    paths = [m.path for m in mounts]
    for one, other in itertools.permutations(paths, 2):
        if other == one or other.startswith(one + "/"):
            raise ValueError(f"mounts {one!r} and {other!r} overlap: give each its own place")
    return mounts


def mount_places(mounts: Iterable[DirectoryMount]) -> list[tuple[str, bool]]:
    """Where mounts are, and whether read-only, in order: what a whole saved sandbox keeps of
    them (the host directories behind them may be others when it is restored)."""
    return sorted((mount.path, mount.read_only) for mount in mounts)


class SandboxSpec(BaseModel):
    """Everything needed to start one sandbox."""

    limits: ResourceLimits = Field(default_factory=ResourceLimits)
    env: Annotated[dict[str, str], AfterValidator(check_environment)] = Field(
        default_factory=dict, description="Environment variables of the kernel, for its lifetime."
    )
    image: str | None = Field(None, description="Kernel image (Docker); None for the default.")
    # The workspace is mounted at both: /home/user is E2B's home (sandbox/backends/base.py).
    workdir: Literal["/workspace", "/home/user"] = Field(
        "/workspace",
        description="Where kernels start: the workspace, under either of its two names.",
    )
    default_timeout_s: float = Field(
        300.0, gt=0, description="Time limit of an execution that does not set its own."
    )
    interrupt_grace_s: float = Field(
        3.0,
        gt=0,
        description="How long an interrupted execution may take to stop before the "
        "kernel is restarted.",
    )
    output_limit_chars: int = Field(
        1_000_000,
        ge=1000,
        description="Most characters kept of each of stdout and stderr per "
        "execution; the rest is dropped with a visible marker.",
    )
    result_limit_bytes: int = Field(
        50 << 20,
        ge=1 << 16,
        description="Most bytes of rich results (HTML, images...) kept "
        "per execution; a result past it is replaced by a note.",
    )
    result_limit_count: int = Field(
        1000, ge=1, description="Most rich results kept per execution; the rest are counted."
    )
    host_tools: bool = Field(
        False,
        description="Give the sandbox a host-tool channel: a directory bound read-only at "
        "/run/host-tools where the host puts a Unix socket, so the code can call tools the host "
        "allows (see sandbox/host_channel.py). No network is involved.",
    )
    runtime: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The OCI runtime of its containers (Docker only), e.g. `runsc` for gVisor; "
        "None for the deployment's. Other backends refuse any (docs/gvisor.md).",
    )
    network: NetworkPolicy = Field(
        NO_NETWORK,
        description="What the sandbox may reach: 'none' (the default), an allow-list of hosts "
        "and ports, or 'any'; anything but 'none' gives it a proxy on 127.0.0.1:3128 (see "
        "sandbox/egress_channel.py). The service holds it to the deployment's ceiling.",
    )
    mounts: Annotated[list[DirectoryMount], AfterValidator(mounts_apart)] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="Host directories seen in the sandbox (volumes), read-only or not.",
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form metadata.")
