"""Pause, resume, snapshots and forks of Ray sessions across replicas (docs/cluster.md): paused
through one replica, resumed by the next call through the other (in a new session actor, on
whichever node has room) with its variables and files; the stale copy the first replica held
is dropped, not taken for a lost session; a snapshot forked onto both worker nodes; a replica
without a shared saved-states directory refuses, saying what to set. The cluster and the
replicas of test_replicas.py (its fixtures)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import RayTestCluster
from tests.cluster.redis_server import free_port
from tests.cluster.test_replicas import (  # noqa: F401  (fixtures)
    Replica,
    SharedView,
    _create,
    _delete,
    _execute,
    _node_of,
    _polls,
    redis_url,
    replicas,
    store,
)


@pytest.mark.cluster
def test_replica_pause_through_one_resume_through_the_other(
    replicas: tuple[Replica, Replica],  # noqa: F811
    ray_cluster: RayTestCluster,
    store: SharedView,  # noqa: F811
) -> None:
    a, b = replicas
    sid = _create(a)
    try:
        assert (
            _execute(a, sid, "kept = 41\nopen('notes.txt', 'w').write('on disk')")["error"] is None
        )
        before = store.get_session(sid)
        assert before is not None and before.sandbox_handle is not None
        with a.client() as api:
            paused = api.post(f"/v1/sessions/{sid}/pause")
            assert paused.status_code == 200, paused.text
            assert paused.json()["state"] == "paused"
        with b.client() as api:
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
        # The next call, through the other replica, wakes it in a new actor.
        back = _execute(b, sid, "kept + 1")
        assert back["text"] == "42", back
        assert _execute(b, sid, "open('notes.txt').read()")["text"] == "'on disk'"
        after = store.get_session(sid)
        assert after is not None and after.state == "running"
        assert after.sandbox_handle not in (None, before.sandbox_handle)
        assert _node_of(ray_cluster, store, sid) in {n.node_id for n in ray_cluster.nodes[1:]}
        # A, which held the old actor, drops its stale copy and serves the new one: the
        # session is not taken for lost.
        assert _execute(a, sid, "kept + 2")["text"] == "43"
        with a.client() as api:
            resumed = api.post(f"/v1/sessions/{sid}/resume")
            assert resumed.status_code == 200 and resumed.json()["session"]["state"] == "running"
    finally:
        _delete(b, sid)


@pytest.mark.cluster
def test_replica_a_stale_copy_is_paused_resumed_and_deleted_through_its_replica(
    replicas: tuple[Replica, Replica],  # noqa: F811
    store: SharedView,  # noqa: F811
) -> None:
    """B holds a copy of a session A paused (or resumed elsewhere): B's own pause, resume and
    delete act on the session as the record has it, never answer 404 for B's stale copy."""
    a, b = replicas
    sid = _create(a)
    try:
        _execute(a, sid, "kept = 'both'")
        assert _execute(b, sid, "kept")["text"] == "'both'"  # B holds a copy now
        _pause(a, sid)
        with b.client() as api:  # looked at through B: as its record has it, not B's copy
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
            assert [s["state"] for s in api.get("/v1/sessions").json() if s["id"] == sid] == [
                "paused"
            ]
        assert _pause(b, sid)["state"] == "paused"  # B's copy was stale: paused already
        assert _execute(a, sid, "kept")["text"] == "'both'"  # resumed through A
        assert _execute(b, sid, "kept")["text"] == "'both'"  # B attaches to the new actor
        _pause(a, sid)  # B's copy is stale again
        with b.client() as api:
            resumed = api.post(f"/v1/sessions/{sid}/resume")
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["session"]["state"] == "running"
        _pause(b, sid)  # A's copy is stale now
        with a.client() as api:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        assert store.get_session(sid) is None
        with b.client() as api:  # deleted while paused: ended for every replica, with why
            gone = api.get(f"/v1/sessions/{sid}")
        assert gone.status_code == 410 and "was deleted" in gone.text, gone.text
    finally:
        _delete(b, sid)


@pytest.mark.cluster
def test_replica_reapers_never_take_a_resumed_session_for_lost(
    replicas: tuple[Replica, Replica],  # noqa: F811
) -> None:
    """Every replica's reaper probes each running session's actor every round: after a pause
    and a resume through A, B's reaper holds a probe of the old actor, which is gone on
    purpose; the session lives on (B's probe is let go, not the session)."""
    a, b = replicas
    sid = _create(a)
    try:
        _execute(a, sid, "kept = 1")
        _settle_reapers(b)  # B's reaper has probed the session's actor
        _pause(a, sid)
        assert _execute(a, sid, "kept")["text"] == "1"  # resumed in a new actor
        _settle_reapers(b)  # B's reaper rounds meet the old actor gone
        assert _execute(a, sid, "kept")["text"] == "1"
        assert _execute(b, sid, "kept")["text"] == "1"
    finally:
        _delete(a, sid)


def _pause(replica: Replica, sid: str) -> dict[str, object]:
    with replica.client() as api:
        paused = api.post(f"/v1/sessions/{sid}/pause")
    assert paused.status_code == 200, paused.text
    info: dict[str, object] = paused.json()
    return info


def _settle_reapers(replica: Replica) -> None:
    """Until the replica's reaper (every 0.5 s here) has run two more whole rounds: what it did
    to the session meanwhile is what the test looks at next."""
    start = sum(replica.metric("cir_reaper_rounds_total").values())
    for _ in _polls(60):
        if sum(replica.metric("cir_reaper_rounds_total").values()) >= start + 2:
            return
    pytest.fail(f"replica {replica.name}'s reaper ran no two rounds in 60 s")


@pytest.mark.cluster
def test_replica_snapshot_forked_onto_both_nodes(
    replicas: tuple[Replica, Replica],  # noqa: F811
    ray_cluster: RayTestCluster,
    store: SharedView,  # noqa: F811
) -> None:
    a, b = replicas
    source = _create(a)
    forks: list[str] = []
    try:
        _execute(a, source, "base = 'from the snapshot'")
        with a.client() as api:
            taken = api.post(f"/v1/sessions/{source}/snapshots", json={"name": "base"})
        assert taken.status_code == 201, taken.text
        snapshot_id = taken.json()["id"]
        _delete(a, source)
        for _ in range(2):  # each placed on the node with the most room: one on each
            forks.append(_create(b, snapshot_id=snapshot_id))
        for fork in forks:
            assert _execute(b, fork, "base")["text"] == "'from the snapshot'"
        assert {_node_of(ray_cluster, store, f) for f in forks} == {
            n.node_id for n in ray_cluster.nodes[1:3]
        }
        # A snapshot forks are made from is kept while any is made; deleted after, through A.
        with a.client() as api:
            assert api.delete(f"/v1/snapshots/{snapshot_id}").status_code == 204
    finally:
        for fork in forks:
            _delete(b, fork)


def _another_replica(
    like: Replica, ray_cluster: RayTestCluster, store_url: str, state_dir: Path, **env: str
) -> Replica:
    """A third replica of the same service (its keys, store and orchestrator id), its state dir
    its own, with `env` changed (a value "" removes the setting)."""
    changed = {**like.env, "CODE_INTERPRETER_STATE_DIR": str(state_dir / "state"), **env}
    port = free_port()
    argv = [
        sys.executable, "-m", "orchestrator", "serve", "--port", str(port),
        "--backend", "ray", "--ray-address", ray_cluster.address, "--store", store_url,
    ]  # fmt: skip
    environment = {k: v for k, v in changed.items() if v != ""}
    log = state_dir / "c.log"
    return Replica("c", argv, environment, port, log, ray_cluster.cluster.root).start()


@pytest.mark.cluster
def test_replica_idle_sessions_pause_once_and_resume_anywhere(
    replicas: tuple[Replica, Replica],  # noqa: F811
    ray_cluster: RayTestCluster,
    redis_url: str,  # noqa: F811
    store: SharedView,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A replica whose idle timeout is short finds the session due and pauses it (the others,
    whose timeout is long, leave it); the next call through A resumes it."""
    a, _ = replicas
    sid = _create(a)
    c = _another_replica(a, ray_cluster, redis_url, tmp_path, CODE_INTERPRETER_IDLE_TIMEOUT_S="2")
    try:
        _execute(a, sid, "kept = 'across an idle pause'")
        for _ in _polls(60):
            record = store.get_session(sid)
            if record is not None and record.state == "paused":
                break
        else:
            pytest.fail(f"session {sid} was not paused when idle: {store.get_session(sid)}")
        assert _execute(a, sid, "kept")["text"] == "'across an idle pause'"
    finally:
        try:
            _delete(a, sid)
        finally:
            c.stop()


@pytest.mark.cluster
def test_replica_without_shared_saved_states_refuses_to_pause(
    replicas: tuple[Replica, Replica],  # noqa: F811
    ray_cluster: RayTestCluster,
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    a, _ = replicas
    c = _another_replica(a, ray_cluster, redis_url, tmp_path, CODE_INTERPRETER_SAVED_STATES_DIR="")
    sid = _create(c)
    try:
        with c.client() as api:
            refused = api.post(f"/v1/sessions/{sid}/pause")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["type"] == "PauseUnsupported"
        assert "CODE_INTERPRETER_SAVED_STATES_DIR" in error["message"]
    finally:
        _delete(c, sid)
        c.stop()
