"""What a caller asks of a process and what it is told back."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

from code_interpreter_wire.spec import check_environment

# A shell command runs as `bash -l -c`: a login shell, as agent frameworks (and E2B) run them.
LOGIN_SHELL = ("/bin/bash", "-l", "-c")


class TerminalSize(BaseModel):
    cols: int = Field(80, ge=1, le=1000)
    rows: int = Field(24, ge=1, le=1000)


class ProcessRequest(BaseModel):
    """A process to start: `argv` as it is, or `command` through a login shell."""

    argv: list[str] | None = Field(None, min_length=1, max_length=4096)
    command: str | None = Field(None, description="A shell command line, run by `bash -l -c`.")
    env: Annotated[dict[str, str], AfterValidator(check_environment)] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="Working directory; the workspace if unset.")
    stdin: bool = Field(False, description="Keep stdin open for input (else it reads nothing).")
    timeout_s: float | None = Field(None, gt=0, description="Killed, with its children, after.")
    terminal: TerminalSize | None = Field(None, description="Run it in a terminal (a PTY).")
    tag: str | None = Field(None, max_length=256, description="A name to find it by.")
    user: Literal["root"] | None = Field(
        None,
        description="`root`: as the sandbox's root, where its backend gives it one (gvisor: "
        "installs with apt, npm -g, pip); refused elsewhere, saying so. Unset: the sandbox's "
        "own unprivileged user.",
    )

    @model_validator(mode="after")
    def _one_command(self) -> ProcessRequest:
        if (self.argv is None) == (self.command is None):
            raise ValueError("give either argv or command, not both and not neither")
        for text in [*(self.argv or []), self.command or "", self.cwd or ""]:
            if "\0" in text:
                raise ValueError("a command, argument or cwd holds a NUL character")
        return self

    def full_argv(self) -> list[str]:
        return list(self.argv) if self.argv is not None else [*LOGIN_SHELL, self.command or ""]


Stream = Literal["stdout", "stderr", "pty"]


class ProcessOutput(BaseModel):
    """A chunk of a process's output, as it happened."""

    type: Literal["output"] = "output"
    stream: Stream
    data: bytes


class ProcessEnd(BaseModel):
    """How a process ended."""

    type: Literal["end"] = "end"
    exit_code: int | None = Field(description="Its exit status; None when a signal ended it.")
    signal: int | None = Field(None, description="The signal that ended it, if one did.")
    timed_out: bool = False
    error: str | None = Field(None, description="Why it ended, when it did not exit 0.")


class ProcessInfo(BaseModel):
    pid: int = Field(description="Its id in the sandbox (its pid there, where known).")
    argv: list[str]
    command: str | None
    env: dict[str, str]
    cwd: str | None
    tag: str | None
    terminal: bool
    running: bool
    end: ProcessEnd | None = None


class CommandResult(BaseModel):
    """A finished command: its end and its output, kept within the output limits."""

    pid: int
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    error: str | None = None
    stdout: str
    stderr: str
    stdout_dropped: int = Field(0, description="Characters dropped from the middle of stdout.")
    stderr_dropped: int = 0
    duration_s: float
