"""What an Agents SDK sandbox session is asked for (its options) and what resumes it (its state),
and the refusals of what a code-interpreter sandbox cannot do (other users, another root,
pausing or service snapshots without a service)."""

from __future__ import annotations

from typing import Literal

from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSessionState
from agents.sandbox.session.sandbox_client import BaseSandboxClientOptions
from agents.sandbox.types import User

from code_interpreter_client.agents_sandbox.errors import ServiceOnly, SingleUser
from code_interpreter_wire.network_policy import NetworkPolicy

BACKEND_ID = "code_interpreter"
WORKSPACE = "/workspace"  # where every code-interpreter sandbox keeps its files
WorkspacePersistence = Literal["tar", "snapshot"]


class CodeInterpreterSandboxClientOptions(BaseSandboxClientOptions):
    """Per-session choices. `backend`: which backend the sandbox runs on (embedded: `local`
    unless named; through a service: the service's default unless named). `network`: what its
    code may reach ('none', 'any', a list of allowed hosts such as `["pypi.org",
    "*.pythonhosted.org"]`; docs/network.md); the service's default (or, embedded, the spec's)
    unless given.

    Through a service only (embedded sessions end with this process, so both are refused
    there): `pause_on_exit` pauses the service session when the sandbox shuts down instead of
    ending it, and a resume wakes it with its variables and files. `workspace_persistence`:
    "tar" (a tar of the workspace, for any snapshot store) or "snapshot" (a snapshot of the
    service, named after the SDK's snapshot id, that keeps variables too; the SDK's store
    holds only a reference to it, and a tar is made instead when the SDK asks for paths to be
    left out)."""

    type: Literal["code_interpreter"] = "code_interpreter"
    backend: str | None = None
    network: NetworkPolicy | None = None
    pause_on_exit: bool = False
    workspace_persistence: WorkspacePersistence = "tar"


class CodeInterpreterSandboxSessionState(SandboxSessionState):
    """What resumes a session: the service session it runs in, found again by id if alive
    (woken if paused)."""

    type: Literal["code_interpreter"] = "code_interpreter"
    backend: str | None = None
    network: NetworkPolicy | None = None
    code_session_id: str | None = None
    pause_on_exit: bool = False
    workspace_persistence: WorkspacePersistence = "tar"


def check_service_options(
    embedded: bool, pause_on_exit: bool, persistence: WorkspacePersistence
) -> None:
    if embedded and pause_on_exit:
        raise ServiceOnly("pause_on_exit=True")
    if embedded and persistence == "snapshot":
        raise ServiceOnly('workspace_persistence="snapshot"')


def refuse_user(user: str | User | None) -> None:
    if user is not None:
        raise SingleUser()


def check_root(manifest: Manifest) -> None:
    if manifest.root != WORKSPACE:
        raise ValueError(
            f"the workspace of a code-interpreter sandbox is {WORKSPACE}; the manifest's root "
            f"is {manifest.root!r}: leave `root` at its default"
        )
