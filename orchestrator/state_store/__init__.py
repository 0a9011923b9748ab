"""What outlives the service's process: session records, saved states and snapshots, and the
connections every store shares (the state dir's SQLite file, `sqlite_db.py`; a cluster's
Redis, `redis_connection.py`, with its password check, `redis_auth.py`).

Behind small async interfaces (`interfaces.py`) so that one machine keeps them in SQLite under
the state dir (`sqlite_store.py`) and a cluster in Redis (`redis_store.py`), without the service
knowing which. Governance's records live in orchestrator/governance/stores/, the cluster's
coordination in orchestrator/cluster/coordination_store.py, on the same connections.
"""

from orchestrator.state_store.interfaces import SessionStore, SnapshotStore, StateStore
from orchestrator.state_store.records import SessionRecord, SnapshotRecord
from orchestrator.state_store.sqlite_db import SqliteDatabase
from orchestrator.state_store.sqlite_store import SqliteStore

__all__ = [
    "SessionRecord",
    "SessionStore",
    "SnapshotRecord",
    "SnapshotStore",
    "SqliteDatabase",
    "SqliteStore",
    "StateStore",
]
