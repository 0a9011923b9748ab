"""The OpenAI Agents SDK's sandbox interface on our sessions: a `SandboxAgent` runs natively in
a code-interpreter sandbox, embedded in this process or through a running service.

    from agents import Runner, RunConfig
    from agents.run_config import SandboxRunConfig
    from code_interpreter_client.agents_sandbox import CodeInterpreterSandboxClient

    client = CodeInterpreterSandboxClient()  # embedded, on the local backend
    # or: CodeInterpreterSandboxClient(base_url="http://127.0.0.1:8000", api_key="...")
    config = RunConfig(sandbox=SandboxRunConfig(client=client))
    result = await Runner.run(agent, "...", run_config=config)

Every call goes through a `CodeSession` (embedded or remote), so it runs on the shared background
loop and through `Service`, like every other front door. Commands, the model's terminal sessions
(background processes), files and workspace snapshots all live inside the one sandbox of the
session: the same user, workspace, limits and no network as its kernel.

Files in the workspace move through the files API (binary-safe, no output caps); other paths
(only reachable with the manifest's extra path grants) go through commands. A snapshot is a tar of
the workspace with members relative to it, made and unpacked by `tar` inside the sandbox; or,
through a service with `workspace_persistence="snapshot"`, a reference to one of the service's
snapshots, which keeps the kernel's variables as well as the files.

Through a service, `pause_on_exit=True` pauses the session when the SDK shuts its sandbox down
(the Runner does at the end of a run) instead of ending it: the service keeps its variables and
files, and `resume()` wakes that same session, so a later run finds them as they were.
"""

from code_interpreter_client.agents_sandbox.client import CodeInterpreterSandboxClient
from code_interpreter_client.agents_sandbox.options import (
    CodeInterpreterSandboxClientOptions,
    CodeInterpreterSandboxSessionState,
)
from code_interpreter_client.agents_sandbox.session import CodeInterpreterSandboxSession

__all__ = [
    "CodeInterpreterSandboxClient",
    "CodeInterpreterSandboxClientOptions",
    "CodeInterpreterSandboxSession",
    "CodeInterpreterSandboxSessionState",
]
