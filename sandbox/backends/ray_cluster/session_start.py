"""A session actor asked of Ray on one node, then started: shared by the backend's placement
(backend.py) and the nodes' warm pools (warm_pool.py)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.names import SESSION_RESOURCE
from sandbox.backends.ray_cluster.session_actor import SessionActor, SessionFacts

_remote_class: Any = None


def new_session_actor(
    name: str,
    namespace: str,
    node_id: str,
    sandbox_id: str,
    spec: SandboxSpec,
    config: RayBackendConfig,
    *,
    claimed: bool = True,
) -> Any:
    """Ask Ray for a session actor on that node (placed, not yet started)."""
    global _remote_class
    if _remote_class is None:
        _remote_class = ray.remote(SessionActor)
    return _remote_class.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        max_restarts=0,  # never a silent fresh kernel
        max_task_retries=0,
        num_cpus=0,
        resources={SESSION_RESOURCE: 1},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(sandbox_id, spec, config.orchestrator_id, claimed=claimed, namespace=namespace)


async def start_session(
    actor: Any, name: str, *, restore: tuple[str, str] | None = None
) -> SessionFacts:
    """Start the actor's sandbox (`restore`: from the saved machine it received under that
    token, woken or forked: node_machines.py); its errors as the node raised them."""
    try:
        if restore is None:
            facts: SessionFacts = await actor.start.remote()
        else:
            facts = await actor.start_restored.remote(*restore)
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise
    except RayActorError as exc:
        raise SandboxStartError(f"the session actor {name} died while starting: {exc}") from None
    return facts
