"""Typed errors of the sandbox layer. Each says what went wrong and, where it can, what to do.

They are wire types: the HTTP API names an error by its class (`APIError.kind`), and an embedded
session raises them to the client's caller, so both sides share these classes."""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error this package raises on purpose."""


class BackendUnavailable(SandboxError):
    """The backend cannot run here (a missing program or engine), or cannot be reached for now
    (a cluster node or control plane not answering: retry); the message says which."""


class SandboxStartError(SandboxError):
    """A sandbox or its kernel failed to start."""


class SandboxClosed(SandboxError):
    """The sandbox was closed; create a new one."""


class SandboxPausing(SandboxError):
    """The session is being paused (through another replica of a cluster): call again in a
    moment, and it answers (resumed)."""


class InvalidPath(SandboxError, ValueError):
    """A workspace path is absolute, climbs out with '..', holds a NUL byte or is unsafe."""


class FileAccessError(SandboxError):
    """A workspace file operation was refused (missing file, a symlink, a directory...)."""


class FileMissing(FileAccessError):
    """The file or directory does not exist in the workspace."""


class FileTooLarge(SandboxError):
    """A file is over the configured transfer limit."""


class BackendRateLimited(SandboxError):
    """A remote backend (E2B) is rate-limiting this service; retry later."""


class BackendTimeout(SandboxError):
    """A remote backend (E2B) did not answer in time; the sandbox may still be running."""


class ProcessNotFound(SandboxError):
    """No process of this sandbox has that pid (or tag); it may have ended long ago."""


class ProcessLimitReached(SandboxError):
    """The sandbox runs as many processes as it may; wait for one to end or kill one."""


class ProcessesUnsupported(SandboxError):
    """This backend cannot run processes beside its kernel; the message says why."""


class ProcessStateError(SandboxError):
    """The process cannot do that now: input to one started without stdin or that closed it, a
    resize of one without a terminal, anything to one that has ended."""


class UnknownLanguage(SandboxError, ValueError):
    """A language name nobody knows (not merely one this sandbox lacks)."""


class LanguageUnavailable(SandboxError):
    """A known language whose kernel this sandbox does not have; the message lists those it has."""


class ScopeRefused(SandboxError, ValueError):
    """A per-call variable a language cannot hold (a shell variable named `1-2`)."""


class RuntimeUnavailable(SandboxError, ValueError):
    """An OCI runtime (SandboxSpec.runtime) this backend or engine cannot run sandboxes under;
    the message names those it can."""


class StateNotSaved(SandboxError):
    """The sandbox's state could not be saved or restored as asked (its kernel did not
    answer, or answered what is not understood)."""


class SandboxLost(SandboxError):
    """The sandbox is gone with the machine or process that held it (the message says why);
    nothing of it can be recovered: create a new one."""


class CapacityReached(SandboxError):
    """Every place that could hold a new sandbox is full (the message says how full, and what
    to do: try again later, or add capacity)."""


class PortUnreachable(SandboxError):
    """Nothing answers on the port asked for inside the sandbox (no server listens there yet,
    or it is not a TCP port): start the server, or ask for the port it listens on."""


class RootUnavailable(SandboxError, ValueError):
    """A process asked to run as root in a sandbox that has none (its backend keeps every
    process unprivileged): run it as the sandbox's user, or in a gvisor session."""
