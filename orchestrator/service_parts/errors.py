"""The refusals the service's parts raise beside the session manager's: each maps to one HTTP
status, and its class name is the `error.type` a client reads."""

from __future__ import annotations

from code_interpreter_wire.tool_arguments import SHELL_TOOL_NAME
from orchestrator.sessions import SessionError


class LimitTooHigh(SessionError):
    status = 400


class ImageNotAllowed(SessionError):
    status = 400


class RuntimeNotAllowed(SessionError):
    """A runtime the operator does not allow, the engine lacks, or the backend has no choice of."""

    status = 400


class NetworkNotAllowed(SessionError):
    """A network policy beyond the operator's ceiling, or on a backend that cannot hold one."""

    status = 400


class PauseUnsupported(SessionError):
    """Pause, resume and snapshots of a session whose backend cannot keep one across them."""

    status = 409

    def __init__(self, backend: str, *, shared: bool = False) -> None:
        if shared:  # it could, were its saved states where every replica finds them
            super().__init__(
                f"sessions of the {backend} backend are served by every replica, and this "
                "service keeps no saved states where every replica finds them: no pause, "
                "resume or snapshot of its sessions (a session idle too long ends instead). "
                "The operator sets CODE_INTERPRETER_SAVED_STATES_DIR to a directory every "
                "replica mounts (docs/cluster.md); until then, save what you need with a "
                "download"
            )
            return
        super().__init__(
            f"the {backend} backend does not keep sessions across pauses yet: no pause, resume "
            "or snapshot of its sessions; a session that is idle too long ends instead. Save "
            "what you need with a download, or use a backend of one machine (local, docker)"
        )


class ResumeFailed(SessionError):
    """A paused session could not be started again; it stays paused, nothing lost."""

    status = 503


class ToolsNotAvailable(SessionError):
    """A session asked for host tools that are not registered, or its backend has no channel."""

    status = 400


class ShellToolOff(SessionError):
    """The `run_command` tool is asked for, but the operator has not turned it on."""

    status = 404

    def __init__(self) -> None:
        super().__init__(
            f"the {SHELL_TOOL_NAME} tool is off on this service; the operator turns it on "
            "with CODE_INTERPRETER_SHELL_TOOL=true (the shell_tool setting)"
        )
