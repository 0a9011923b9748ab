"""Governance's records and the stores that keep them: approval requests, the audit log, keys
as principals, and (shared by a cluster's replicas) the running origins of host-tool calls.

Each is a small async interface (`*_store.py`) with a SQLite implementation, kept in the
service's state file (orchestrator/state_store/sqlite_db.py), and a Redis one, kept in the
Redis a cluster shares (orchestrator/state_store/redis_connection.py). `sqlite_stores` and
`redis_stores` make the set a service (or the CLI) works through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.governance.stores.approval_store import ApprovalStore
from orchestrator.governance.stores.audit_store import AuditStore
from orchestrator.governance.stores.principal_store import PrincipalStore
from orchestrator.state_store.sqlite_db import SqliteDatabase

if TYPE_CHECKING:  # Redis is the [cluster] extra's: imported only where one is used
    from orchestrator.governance.stores.redis_origins import RedisOrigins
    from orchestrator.state_store.redis_connection import RedisConnection


@dataclass(frozen=True)
class GovernanceStores:
    approvals: ApprovalStore
    audit: AuditStore
    principals: PrincipalStore
    origins: RedisOrigins | None  # only where replicas share calls' origins (a cluster)

    def close(self) -> None:
        """Let go of what the stores hold besides their database's connection."""
        self.audit.close()


def sqlite_stores(db: SqliteDatabase) -> GovernanceStores:
    """Governance's stores in the service's SQLite file."""
    from orchestrator.governance.stores.sqlite_approvals import SqliteApprovals
    from orchestrator.governance.stores.sqlite_audit import SqliteAudit
    from orchestrator.governance.stores.sqlite_principals import SqlitePrincipals

    return GovernanceStores(
        approvals=SqliteApprovals(db),
        audit=SqliteAudit(db),
        principals=SqlitePrincipals(db),
        origins=None,
    )


def redis_stores(connection: RedisConnection, *, max_listed: int = 10_000) -> GovernanceStores:
    """Governance's stores in the Redis a cluster shares (`max_listed`: the most approval
    requests one listing looks at)."""
    from orchestrator.governance.stores.redis_approvals import RedisApprovals
    from orchestrator.governance.stores.redis_audit import RedisAudit
    from orchestrator.governance.stores.redis_origins import RedisOrigins
    from orchestrator.governance.stores.redis_principals import RedisPrincipals

    return GovernanceStores(
        approvals=RedisApprovals(connection, max_listed=max_listed),
        audit=RedisAudit(connection),
        principals=RedisPrincipals(connection),
        origins=RedisOrigins(connection),
    )
