"""Prometheus metrics of the service, served at /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.sessions_active = Gauge(
            "cir_sessions_active", "Sessions open now.", ["backend"], registry=r
        )
        self.sessions_created = Counter(
            "cir_sessions_created",
            "Sessions created, by source.",
            ["backend", "source"],
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
        # `language` is a canonical name (sandbox/languages.py): a bounded set of values.
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


METRICS = Metrics()
