"""The ray backend's configuration: which cluster, how its actors are named, its warm pools.
Free of Ray, so it can be read and checked where Ray is absent."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.names import NAMESPACE, check_orchestrator_id


class RayBackendConfig(BaseModel):
    address: str | None = Field(
        None,
        description="The cluster to join (`host:port` of its head); None: `RAY_ADDRESS`, else "
        "a cluster already running on this machine. A new cluster is never started.",
    )
    namespace: str = Field(NAMESPACE, description="The Ray namespace of the session actors.")
    orchestrator_id: str = Field(
        "default", description="Names this service's session actors (replicas share it)."
    )
    node_ip: str | None = Field(
        None,
        description="This process's address in the cluster (Ray's `_node_ip_address`); "
        "127.0.0.1 keeps everything on loopback (one-machine clusters).",
    )
    pool_size_per_node: int = Field(
        0,
        ge=0,
        le=64,
        description="Warm session actors kept ready on each node; 0: none. The first replica "
        "to reach a node's keeper sets its size.",
    )
    pool_spec: SandboxSpec = Field(
        default_factory=SandboxSpec, description="The spec warm pools keep sandboxes of."
    )
    placement_wait_s: float = Field(
        30.0,
        gt=0,
        description="How long an actor may stay unplaced before its node counts as full.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Join a cluster at a non-loopback address without RAY_AUTH_MODE=token in "
        "the environment: only on a private network nobody else reaches (docs/cluster.md, "
        "'Securing the cluster').",
    )

    egress_relayed: bool = Field(
        False,
        description="Whether whoever drives this backend opens each networked session's egress "
        "proxy on its node and takes its records (`RaySandbox.open_egress`, `egress_records`). "
        "Until it does, a session asking for a network is refused: it would have no way out "
        "and no record of its attempts.",
    )

    machine_images_dir: Path | None = Field(
        None,
        description="A directory every replica mounts where paused sessions' whole machines "
        "wait (machine_store.py): with it, a session on a node whose backend saves whole "
        "machines (gVisor) pauses whole and resumes on any such node; without it, its "
        "kernel's state is saved instead. The service sets it inside its saved_states_dir.",
    )

    @field_validator("orchestrator_id")
    @classmethod
    def _plain_id(cls, value: str) -> str:
        return check_orchestrator_id(value)
