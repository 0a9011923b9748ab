"""The names the ray backend gives things in the cluster, in one place, so that every replica
(and the tests) read them the same way.

A session actor is named `cir:<orchestrator id>:<sandbox id>` in the namespace
`code-interpreter`: the orchestrator id in the name lets a replica list its own sessions with
one call to the cluster (`ray.util.list_named_actors`), and `:` never occurs in either part.
A node's warm pool keeper is `cir-pool:<orchestrator id>:<spec digest>:<node id>`, and the
count of the service's egress connections `cir-egress:<orchestrator id>`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from code_interpreter_wire.spec import SandboxSpec

NAMESPACE = "code-interpreter"
# The custom resource a node offers sessions by (`ray start --resources='{"cir_sessions": N}'`);
# each session actor takes one, so Ray itself holds every node to its cap.
SESSION_RESOURCE = "cir_sessions"
# The node's environment chooses the local backend of its sandboxes and where they keep state.
NODE_BACKEND_ENV = "CIR_NODE_BACKEND"
NODE_STATE_DIR_ENV = "CIR_NODE_STATE_DIR"
NODE_BACKENDS = ("local", "docker", "gvisor")
_SESSION = "cir"
_POOL = "cir-pool"
_EGRESS_COUNT = "cir-egress"


def check_orchestrator_id(orchestrator_id: str) -> str:
    if not orchestrator_id or ":" in orchestrator_id:
        raise ValueError(
            f"the ray backend's orchestrator id must be non-empty and hold no ':' "
            f"(got {orchestrator_id!r})"
        )
    return orchestrator_id


def session_actor_name(orchestrator_id: str, sandbox_id: str) -> str:
    return f"{_SESSION}:{orchestrator_id}:{sandbox_id}"


def session_prefix(orchestrator_id: str) -> str:
    """What the names of this orchestrator's session actors start with."""
    return f"{_SESSION}:{orchestrator_id}:"


def pool_keeper_name(orchestrator_id: str, spec: SandboxSpec, node_id: str) -> str:
    return f"{_POOL}:{orchestrator_id}:{spec_digest(spec)}:{node_id}"


def pool_prefix(orchestrator_id: str) -> str:
    return f"{_POOL}:{orchestrator_id}:"


def egress_counter_name(orchestrator_id: str) -> str:
    return f"{_EGRESS_COUNT}:{orchestrator_id}"


def spec_digest(spec: SandboxSpec) -> str:
    """A short name of a spec: sandboxes of equal specs are interchangeable in a pool."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def node_backend_name() -> str:
    """The local backend this node runs sandboxes with (its `CIR_NODE_BACKEND`)."""
    name = os.environ.get(NODE_BACKEND_ENV, "local") or "local"
    if name not in NODE_BACKENDS:
        raise ValueError(
            f"{NODE_BACKEND_ENV}={name!r} on this node; choose one of: {', '.join(NODE_BACKENDS)}"
        )
    return name


def node_state_dir() -> Path:
    """Where this node's sandboxes keep their directories (its `CIR_NODE_STATE_DIR`): short,
    since kernel sockets live under it."""
    configured = os.environ.get(NODE_STATE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"cir-node-{os.geteuid()}"
