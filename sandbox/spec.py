"""What a caller asks of a sandbox: resource limits, environment and execution defaults."""

from __future__ import annotations

from typing import Annotated

import annotated_types
from pydantic import AfterValidator, BaseModel, Field


class ResourceLimits(BaseModel):
    """Per-sandbox limits. Defaults are safe for untrusted code on a small machine; each field's
    upper bound (`le`) is the ceiling no session may pass, whatever it asks for.

    Which backend enforces what is spelled out in the README ("Limits, honestly").
    """

    memory_mb: int = Field(
        2048, ge=64, le=16384, description="Memory for the whole sandbox, in MiB."
    )
    cpus: float = Field(1.0, gt=0, le=4, description="CPU quota in cores (Docker).")
    pids: int = Field(256, ge=16, le=4096, description="Most processes and threads at once.")
    file_size_mb: int = Field(
        1024, ge=1, le=8192, description="Largest single file the code may write."
    )
    open_files: int = Field(
        1024, ge=64, le=65536, description="Most open file descriptors per process."
    )
    tmp_size_mb: int = Field(512, ge=1, le=8192, description="Size of the private /tmp.")
    workspace_size_mb: int = Field(
        1024,
        ge=1,
        le=16384,
        description="Size of the workspace (a tmpfs when the orchestrator is root).",
    )


def limit_ceilings() -> dict[str, float]:
    """Each limit's ceiling, read from its field's upper bound."""
    ceilings: dict[str, float] = {}
    for name, info in ResourceLimits.model_fields.items():
        bound = next(m.le for m in info.metadata if isinstance(m, annotated_types.Le))
        assert isinstance(bound, int | float)
        ceilings[name] = bound
    return ceilings


def check_environment(env: dict[str, str]) -> dict[str, str]:
    """Refuse what no environment can hold: a NUL anywhere (it would end the string, or an
    argument of a launcher), an empty name, or `=` in a name."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"{name!r} is not an environment variable name")
        if "\0" in value:
            raise ValueError(f"the value of {name} holds a NUL character")
    return env


class SandboxSpec(BaseModel):
    """Everything needed to start one sandbox."""

    limits: ResourceLimits = Field(default_factory=ResourceLimits)
    env: Annotated[dict[str, str], AfterValidator(check_environment)] = Field(
        default_factory=dict, description="Environment variables of the kernel, for its lifetime."
    )
    image: str | None = Field(None, description="Kernel image (Docker); None for the default.")
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
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form metadata.")
