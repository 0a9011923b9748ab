"""Prometheus metrics of the service, served at /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        # Per replica: in cluster mode each replica counts the sessions it holds now (made or
        # attached here), so the sum over replicas counts a session served by two twice; the
        # cluster's count is cir_node_sessions (the Ray cluster's own, the same on every replica).
        self.sessions_active = Gauge(
            "cir_sessions_active",
            "Sessions open now that this replica holds (made or served here).",
            ["backend"],
            registry=r,
        )
        self.sessions_created = Counter(
            "cir_sessions_created",
            "Sessions created, by source.",
            ["backend", "source"],
            registry=r,
        )
        self.reaper_rounds = Counter(
            "cir_reaper_rounds",
            "Rounds of the reaper (expiries, the cluster's walk, sweeps) this process ran.",
            registry=r,
        )
        self.sessions_expired = Counter(
            "cir_sessions_expired", "Sessions ended by expiry.", registry=r
        )
        self.sessions_paused = Counter(
            "cir_sessions_paused",
            "Sessions paused (their state saved, their sandbox stopped).",
            registry=r,
        )
        self.sessions_resumed = Counter(
            "cir_sessions_resumed", "Paused sessions started again.", registry=r
        )
        # `language` is a canonical name (code_interpreter_wire/languages.py): a bounded set of
        # values.
        self.executions = Counter(
            "cir_executions",
            "Executions, by how they ended and in which language.",
            ["backend", "status", "language"],
            registry=r,
        )
        self.execution_seconds = Histogram(
            "cir_execution_seconds",
            "Wall time of executions.",
            ["backend"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.commands = Counter(
            "cir_commands",
            "Commands run to their end, by outcome.",
            ["backend", "outcome"],
            registry=r,
        )
        self.processes_started = Counter(
            "cir_processes_started",
            "Background processes and terminals started.",
            ["backend"],
            registry=r,
        )
        self.egress_connections = Counter(
            "cir_egress_connections",
            "Connections through sessions' egress proxies, allowed or refused.",
            ["backend", "decision"],
            registry=r,
        )
        self.egress_bytes = Counter(
            "cir_egress_bytes",
            "Bytes through sessions' egress proxies, by direction (up: to the destination).",
            ["backend", "direction"],
            registry=r,
        )
        self.errors = Counter("cir_errors", "Requests that failed, by kind.", ["kind"], registry=r)
        self.http_connections_closed = Counter(
            "cir_http_connections_closed",
            "HTTP connections refused or closed by the connection guard, by why "
            "(refused_per_address, refused_total, evicted, header_timeout, body_rate, "
            "write_stalled).",
            ["why"],
            registry=r,
        )
        # Cluster mode: one series per node of the Ray cluster (a bounded set: its machines),
        # read from the cluster itself: the cluster-wide truth, whichever replica is asked.
        self.sessions_lost = Counter(
            "cir_sessions_lost", "Sessions whose sandbox was lost with its node.", registry=r
        )
        self.node_sessions = Gauge(
            "cir_node_sessions",
            "Session slots taken on each node of the cluster (warm pool actors included).",
            ["node"],
            registry=r,
        )
        self.node_capacity = Gauge(
            "cir_node_capacity", "Sessions each node of the cluster may hold.", ["node"], registry=r
        )
        self.node_alive = Gauge(
            "cir_node_alive",
            "Whether each node of the cluster is alive (1) or not.",
            ["node"],
            registry=r,
        )


METRICS = Metrics()
