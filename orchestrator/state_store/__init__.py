"""What outlives the service's process: session records, saved states and snapshots.

Behind small interfaces (`interfaces.py`) so that one machine keeps them in SQLite under the state
dir (`sqlite_store.py`) and a cluster in a shared store, without the service knowing which.
"""

from orchestrator.state_store.interfaces import SessionStore, SnapshotStore
from orchestrator.state_store.records import SessionRecord, SnapshotRecord
from orchestrator.state_store.sqlite_store import SqliteStore

__all__ = ["SessionRecord", "SessionStore", "SnapshotRecord", "SnapshotStore", "SqliteStore"]
