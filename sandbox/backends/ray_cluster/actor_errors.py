"""What a failed call to a session actor means for the session, decided in one place for the
sandbox's calls (ray_sandbox.py) and its processes' (remote_process.py).

- The actor's own error (a `SandboxError` raised on the node) comes back as it was raised.
- `ActorDiedError`: the actor is dead for good (`max_restarts=0`): `SandboxLost`, saying where
  it was and why it died, from the GCS's actor table when it still has it.
- Any other actor failure (`ActorUnavailableError`, "temporarily unavailable"; a lost return
  object) is only a loss when the GCS says so: the actor DEAD, unknown, or its node dead. While
  the GCS has both alive it is `BackendUnavailable` (a retryable 503), and the session stays:
  right after a node dies the GCS takes a few health checks to notice, so the fate is read a
  few times over `SETTLE_S` first.
- Any other Ray error is `BackendUnavailable` with Ray's words cut short; an error of the
  node's code that is no `SandboxError` is re-raised as itself, never with Ray's pages of
  remote traceback.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.exceptions import ActorDiedError, ObjectLostError, RayActorError, RayError, RayTaskError

from code_interpreter_wire.errors import BackendUnavailable, SandboxError, SandboxLost
from sandbox.backends.ray_cluster.cluster_state import (
    DEAD,
    ActorFate,
    actor_fate,
    dead_actor_named,
    node_alive,
    short,
)
from sandbox.backends.ray_cluster.session_actor import SessionFacts

SETTLE_S = 2.0  # how long an unreachable actor's fate is read again before "try again later"
_SETTLE_STEP_S = 0.25


def actor_id_of(actor: Any) -> str | None:
    """The hex id of an actor handle (what the GCS's actor table is keyed by)."""
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else None


def is_actor_failure(exc: BaseException) -> bool:
    """Whether Ray says the actor (not the code it ran) failed the call."""
    if isinstance(exc, RayTaskError):
        return isinstance(exc.cause, RayActorError | ObjectLostError)
    return isinstance(exc, RayActorError | ObjectLostError)


async def sandbox_error_of(
    exc: BaseException, name: str, facts: SessionFacts | None, actor_id: str | None
) -> BaseException:
    """The error to raise for a failed call of the actor `name` (see the module's doc)."""
    if isinstance(exc, RayTaskError):  # first: Ray makes it an instance of its cause's class
        cause = exc.cause
        if isinstance(cause, RayActorError | ObjectLostError):
            exc = cause
        elif isinstance(cause, Exception):
            return cause
        else:
            return SandboxError(f"the session actor {name} failed a call: {short(str(exc))}")
    if isinstance(exc, ActorDiedError):
        return SandboxLost(await lost_reason(name, facts, exc, await known_fate(actor_id)))
    if isinstance(exc, RayActorError | ObjectLostError):
        try:
            fate, gone = await settled_fate(actor_id)
        except BackendUnavailable as unknown:  # the GCS does not answer either: not a loss
            return BackendUnavailable(
                f"the session's actor {name} does not answer for now "
                f"({short(str(exc))}), and {unknown}"
            )
        if gone:
            return SandboxLost(await lost_reason(name, facts, exc, fate))
        where = _where(facts, fate)
        state = fate.state if fate is not None else "unknown"
        return BackendUnavailable(
            f"the session's actor {name} on {where} does not answer for now (the cluster has it "
            f"{state}, its node alive): {short(str(exc))}; try again in a moment"
        )
    if isinstance(exc, SandboxError):
        return exc
    if isinstance(exc, RayError):
        return BackendUnavailable(f"the Ray cluster failed a call of {name}: {short(str(exc))}")
    return exc


async def settled_fate(actor_id: str | None) -> tuple[ActorFate | None, bool]:
    """(the actor's entry, whether it is gone: DEAD, unknown, or on a dead node), read again
    for up to `SETTLE_S` while the GCS still has both alive. `BackendUnavailable` when the GCS
    does not answer: that is no loss."""
    if actor_id is None:
        return None, True
    deadline = time.monotonic() + SETTLE_S
    while True:
        fate = await asyncio.to_thread(actor_fate, actor_id)
        if fate is None or fate.state == DEAD:
            return fate, True
        if fate.node_id and await asyncio.to_thread(node_alive, fate.node_id) is False:
            return fate, True
        if time.monotonic() >= deadline:
            return fate, False
        await asyncio.sleep(_SETTLE_STEP_S)


async def lost_reason(
    name: str, facts: SessionFacts | None, exc: BaseException | None, fate: ActorFate | None
) -> str:
    """Why the session is lost, for every later caller: where it was, its node's fate, why
    its actor died (the GCS's death cause if it has it, else Ray's words)."""
    node_id = (facts.node_id if facts is not None else "") or (fate.node_id if fate else "")
    where = _where(facts, fate)
    why = (fate.cause if fate is not None else "") or (short(str(exc)) if exc else "")
    if fate is not None and fate.node_died:
        what = f"its {where} died"
    elif fate is not None and "INTENDED_USER_EXIT" in fate.cause:
        what = f"its actor on {where} was ended (the session was closed or discarded)"
    else:
        alive = await _read(node_alive, node_id) if node_id else None
        if alive is None:
            what = f"its {where} is no longer in the cluster" if node_id else "its node is unknown"
        elif alive and fate is not None and fate.state == DEAD:
            what = f"its {where} is up, but the session's actor died"
        elif alive:  # the GCS has not told yet whether the node went too: no claim either way
            what = f"the session's actor on {where} is gone"
        else:
            what = f"its {where} is dead"
    return f"the session's sandbox is lost: {what} ({name}: {why or 'no cause known'})"


async def known_fate(actor_id: str | None) -> ActorFate | None:
    """The actor's entry in the GCS's table if the GCS answers (for a reason only)."""
    return await _read(actor_fate, actor_id) if actor_id else None


async def lost_by_name(name: str, namespace: str) -> str:
    """Why a session actor that no longer answers to its name is gone, as far as the GCS
    still knows (its dead actors' table keeps the name, where and why for a while)."""
    fate: ActorFate | None = None
    try:
        fate = await asyncio.wait_for(
            asyncio.to_thread(dead_actor_named, name, namespace), SETTLE_S * 5
        )
    except (BackendUnavailable, TimeoutError):
        fate = None
    if fate is None:
        return (
            f"the session's sandbox is lost: no actor named {name} runs in the cluster, and the "
            "cluster no longer says why (its node was lost, or it was ended)"
        )
    return await lost_reason(name, None, None, fate)


def _where(facts: SessionFacts | None, fate: ActorFate | None) -> str:
    node_id = (facts.node_id if facts is not None else "") or (fate.node_id if fate else "")
    address = (facts.address if facts is not None else "") or (fate.address if fate else "")
    return f"node {node_id[:16] or '(unknown)'} ({address or 'address unknown'})"


async def _read(read: Any, *args: Any) -> Any:
    """A GCS read off the event loop; the GCS not answering reads as "don't know" (None)."""
    try:
        return await asyncio.to_thread(read, *args)
    except BackendUnavailable:
        return None
