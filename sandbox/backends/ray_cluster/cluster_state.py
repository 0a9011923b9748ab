"""What the cluster's control plane (the GCS) knows of an actor or a node, read for the ray
backend's decisions: is a session lost or only out of reach for now, why did it die, where was
it, how many slots does each node have free.

Every function here is blocking (a GCS round trip): call it through `asyncio.to_thread`. The
actor table and the per-node free resources are Ray developer APIs (`ray._private.state`):
the public state API (`ray.util.state`) needs the dashboard, which a cluster need not run. They
are imported in one place (`_private_state`), so that a Ray without them fails with a clear
`BackendUnavailable` instead of an `ImportError` deep in a request, and a Ray outside the
versions they were tested with (`TESTED_RAY`) is said in the log once, naming the risk. A GCS
that does not answer is `BackendUnavailable` too: never a raw Ray error.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ray
from packaging.version import InvalidVersion, Version

from code_interpreter_wire.errors import BackendUnavailable

log = logging.getLogger(__name__)
# The Ray versions whose private state API the backend was tested against: from, and below.
TESTED_RAY = (Version("2.55"), Version("2.61"))

_CAUSE_CHARS = 400
# The actor table's states (gcs.proto ActorTableData.ActorState).
DEAD = "DEAD"
ALIVE = "ALIVE"
PENDING = "PENDING_CREATION"
_NODE_DIED = 3  # ActorDiedErrorContext.reason: the actor died with its node


@dataclass(frozen=True)
class ActorFate:
    """One actor as the GCS's actor table has it."""

    state: str  # ALIVE, DEAD, PENDING_CREATION, RESTARTING, DEPENDENCIES_UNREADY
    node_id: str  # where it runs (ran, or is meant to)
    address: str  # its node's address, "" if not known
    cause: str  # why it died, one short line ("" unless dead)
    node_died: bool  # it died with its node
    placed: bool  # a worker process took it (it has a pid)


def _private_state() -> ModuleType:
    try:
        from ray._private import state
    except ImportError as exc:  # pragma: no cover - a Ray upgrade that moved it
        raise BackendUnavailable(
            f"this Ray ({ray.__version__}) lacks ray._private.state, which the ray backend reads "
            f"actors' and nodes' state from ({exc}); install the Ray version pyproject.toml pins"
        ) from None
    for name in ("actors", "available_resources_per_node"):
        if not callable(getattr(state, name, None)):  # pragma: no cover - same
            raise BackendUnavailable(
                f"this Ray ({ray.__version__}) has no ray._private.state.{name}, which the ray "
                "backend needs; install the Ray version pyproject.toml pins"
            )
    untested_ray(ray.__version__)
    return state


@functools.cache  # said once per version, not at every read
def untested_ray(version: str) -> bool:
    """Whether `version` is outside `TESTED_RAY` (then said in the log): its private state API
    may answer differently even where its names are still there."""
    low, high = TESTED_RAY
    try:
        tested = low <= Version(version) < high
    except InvalidVersion:
        tested = False
    if not tested:
        log.warning(
            "Ray %s is not a version the ray backend was tested with (%s up to, not including, "
            "%s): it reads actors' and nodes' state through Ray's private API "
            "(ray._private.state), which may change between versions; if sessions are wrongly "
            "said lost or placement misbehaves, install a tested Ray on every node and replica",
            version,
            low,
            high,
        )
    return not tested


def _gcs(what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """A GCS read; the GCS not answering is `BackendUnavailable`, saying what was asked."""
    try:
        return call(*args, **kwargs)
    except BackendUnavailable:
        raise
    except Exception as exc:
        raise BackendUnavailable(
            f"the Ray cluster's control plane (GCS) did not answer {what}: {short(str(exc))}; "
            "try again in a moment"
        ) from None


def actor_fate(actor_id: str) -> ActorFate | None:
    """The actor's entry in the GCS's actor table; None when the GCS has none."""
    state = _private_state()
    info = _gcs("about a session actor", state.actors, actor_id)
    return _fate(info) if info else None


def dead_actor_named(name: str, namespace: str) -> ActorFate | None:
    """The last dead actor of that name: the GCS releases a dead detached actor's name, but
    keeps it in its table of dead actors (a bounded cache) for a while."""
    state = _private_state()
    table = _gcs("about dead actors", state.actors, actor_state_name=DEAD)
    found = [
        info
        for info in table.values()
        if info.get("Name") == name and _namespace_of(info) in ("", namespace)
    ]
    if not found:
        return None
    return _fate(max(found, key=lambda info: info.get("EndTime", 0)))


def node_alive(node_id: str) -> bool | None:
    """Whether the GCS has the node alive; None when it does not know it."""
    for node in _gcs("about the cluster's nodes", ray.nodes):
        if node.get("NodeID") == node_id:
            return bool(node.get("Alive"))
    return None


def cluster_nodes() -> list[dict[str, Any]]:
    """`ray.nodes()`: every node the GCS knows, dead ones too."""
    nodes: list[dict[str, Any]] = _gcs("about the cluster's nodes", ray.nodes)
    return nodes


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Each alive node's free resources, as the GCS last heard them from its raylet."""
    state = _private_state()
    free: dict[str, dict[str, float]] = _gcs(
        "about free resources", state.available_resources_per_node
    )
    return free


def short(text: str, limit: int = _CAUSE_CHARS) -> str:
    """Ray's words on one line and short: its messages run to pages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + " [...]"


def creation_error(exc: BaseException) -> str:
    """What failed in an actor's creation task: the last line of the node's traceback (the
    exception itself, e.g. `ModuleNotFoundError: No module named 'x'`), else Ray's words."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return short(lines[-1] if lines else repr(exc))


def _namespace_of(info: dict[str, Any]) -> str:
    cause = info.get("DeathCause")
    context = getattr(cause, "actor_died_error_context", None)
    return str(getattr(context, "ray_namespace", "") or "")


def _fate(info: dict[str, Any]) -> ActorFate:
    address = info.get("Address") or {}
    cause, node_died = _death_cause(info.get("DeathCause"))
    return ActorFate(
        state=str(info.get("State", "")),
        node_id=str(address.get("NodeID", "")),
        address=str(address.get("IPAddress", "")),
        cause=cause,
        node_died=node_died,
        placed=bool(info.get("Pid")) or bool(address.get("Port")),
    )


def _death_cause(cause: Any) -> tuple[str, bool]:
    """(one line of why, whether its node died) from an ActorDeathCause message."""
    if cause is None:
        return "", False
    try:
        which = cause.WhichOneof("context")
    except Exception:
        return "", False
    if which is None:
        return "", False
    context = getattr(cause, which)
    if which == "actor_died_error_context":
        death = context.node_death_info
        node_died = context.reason == _NODE_DIED or bool(death.reason)
        text = context.error_message
        if node_died and death.reason_message:
            text = f"{text} ({death.reason_message})"
        return short(text), node_died
    if which == "creation_task_failure_context":
        return short(
            context.formatted_exception_string.strip().splitlines()[-1]
            if context.formatted_exception_string.strip()
            else "its creation task failed"
        ), False
    return short(str(getattr(context, "error_message", which))), False
