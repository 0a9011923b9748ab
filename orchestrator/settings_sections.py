"""The settings a part of the service is given: one section each, never the whole `Settings`.

The operator still configures one flat surface (CODE_INTERPRETER_* variables, one TOML file;
docs/configuration.md), validated once in `orchestrator/config.py`. The composition root
(`Service`) cuts it into these frozen sections, so a part's constructor says what it depends on,
a test builds only that, and no part can start reading a setting that belongs to another. A
section's fields keep their flat names: a setting is found by the same name everywhere.

This module imports nothing of the settings' own (an import-linter contract keeps the service's
parts from importing `orchestrator.config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, SecretStr

from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.spec import ResourceLimits
from orchestrator.host_tools.settings import HostToolsSettings
from sandbox.egress.settings import ServiceEndpoint


class Section(BaseModel):
    """A frozen slice of the settings, taken by its fields' names."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    @classmethod
    def of(cls, settings: Any, **derived: Any) -> Self:
        """The section of `settings` (anything with the flat fields as attributes, validated
        already); `derived`: fields computed by the composition root."""
        taken = {name: getattr(settings, name) for name in cls.model_fields if name not in derived}
        return cls.model_validate({**taken, **derived})


def saved_states_path(saved_states_dir: Path | None, state_dir: Path) -> Path:
    """Where saved states are kept (the service's own directory: unrecorded entries there are
    swept as a crash's leftovers)."""
    if saved_states_dir is None:
        return state_dir / "snapshots"
    return saved_states_dir / "code-interpreter-saved-states"


class AuthSection(Section):
    """Who may call: the keys the settings name."""

    api_keys: tuple[str, ...]
    admin_keys: tuple[str, ...]
    auth_disabled: bool


class AuditSection(Section):
    """The audit log (docs/governance.md)."""

    audit_enabled: bool
    audit_retention_s: float
    audit_max_events: int
    audit_queue_max: int
    audit_batch_max: int
    audit_max_code_chars: int
    audit_input_record_bytes: int
    audit_input_records_per_minute: int


class ApprovalSection(Section):
    """Humans who approve risky calls (docs/governance.md)."""

    approval_timeout_s: float
    approval_webhook_url: str | None
    approval_webhook_secret: SecretStr | None
    approval_webhook_timeout_s: float
    approval_max_pending_per_session: int
    approval_max_pending_total: int


class AdmissionSection(Section):
    """What a session may have and a call may do: backends and images, limits, time limits,
    transfer sizes, network policies, the shell tool."""

    default_backend: str
    default_limits: ResourceLimits
    docker_image: str
    docker_images: tuple[str, ...]
    docker_templates: bool
    docker_runtime: str | None
    docker_runtimes: tuple[str, ...]
    execution_timeout_s: float
    max_execution_timeout_s: float
    max_upload_bytes: int
    max_download_bytes: int
    mcp_idle_timeout_s: float
    network_ceiling: NetworkPolicy
    network_default: NetworkPolicy
    network_internet: NetworkPolicy | None
    shell_tool: bool

    @property
    def internet_policy(self) -> NetworkPolicy:
        """What a client asking for internet access gets: `network_internet`, else the ceiling."""
        return self.network_internet if self.network_internet is not None else self.network_ceiling


class ExpirySection(Section):
    """When sessions end or pause by themselves, and how often that is looked at."""

    idle_timeout_s: float
    max_lifetime_s: float
    idle_action: Literal["pause", "end"]
    pause_on_shutdown: bool
    shutdown_pause_timeout_s: float
    paused_retention_s: float
    max_paused_sessions_per_key: int
    reap_interval_s: float


class SessionTableSection(Section):
    """The session table's: which backends, their sessions' default spec and warm pools, the
    caps on sessions, when sessions expire and how often the reaper looks."""

    backends: tuple[str, ...]
    default_backend: str
    default_limits: ResourceLimits
    execution_timeout_s: float
    output_limit_chars: int
    network_default: NetworkPolicy
    pool_size: int
    preload_modules: tuple[str, ...]
    preload_code: str | None
    max_sessions_per_key: int
    max_sessions_total: int
    idle_timeout_s: float
    max_lifetime_s: float
    idle_action: Literal["pause", "end"]
    reap_interval_s: float
    saved_states_dir: Path | None  # set: saved states are where every replica finds them


class ClusterSection(Section):
    """Cluster mode's coordination (docs/cluster.md): the caps every replica shares, claims,
    tombstones and the reaper's batch."""

    state_dir: Path
    saved_states_dir: Path | None
    cluster_tombstone_ttl_s: float
    cluster_reap_batch: int
    cluster_orphan_after_s: float
    max_lifetime_s: float
    idle_timeout_s: float
    max_sessions_per_key: int
    max_sessions_total: int


class StorageSection(Section):
    """Where states are kept and how much of them: the state dir and the saved-state quotas."""

    state_dir: Path
    saved_states_dir: Path | None
    max_saved_state_bytes: int
    max_snapshots_per_key: int
    max_saved_bytes_per_key: int
    cluster_reap_batch: int

    @property
    def saved_states(self) -> Path:
        """Where saved states are kept: a directory of the service's own (under the operator's
        `saved_states_dir`, which may hold other things: nothing else there is touched)."""
        return saved_states_path(self.saved_states_dir, self.state_dir)


class EgressSection(Section):
    """Sessions' way out (docs/network.md): the ceiling, the proxies' caps, what is private and
    what no sandbox may reach (`service_endpoints`, derived: the service's API, store, Ray)."""

    network_ceiling: NetworkPolicy
    egress_private_hosts: tuple[str, ...]
    egress_resolve: Mapping[str, tuple[str, ...]]
    egress_max_bytes_per_session: int
    egress_max_connections_per_session: int
    egress_max_connections_total: int
    egress_max_connections_per_key: int
    egress_upstream_ca_file: Path | None  # trusted beside the system's (docs/secrets.md)
    egress_inspected_ports: tuple[int, ...]  # TLS looked into for placeholders
    service_endpoints: tuple[ServiceEndpoint, ...]


class PortsSection(Section):
    """Inbound ports (docs/ports.md): whether sessions may have them, public or not, where
    their hosts are, and the caps on their connections."""

    ports_enabled: bool
    ports_public: bool
    ports_domain: str | None
    ports_max_connections_per_session: int
    ports_max_connections_total: int
    ports_max_bytes_per_connection: int
    ports_audited_per_minute: int
    ports_timeout_s: float


class ChannelSection(Section):
    """Host tools sessions may call, and how long a call waits for its approval."""

    host_tools: HostToolsSettings
    approval_timeout_s: float


class ViewSection(Section):
    """What answers show beside a session's own state: its expiry, network and images as
    configured, where the service is reached, the size a tool's output is cut to."""

    default_backend: str
    docker_image: str
    docker_images: tuple[str, ...]
    docker_templates: bool
    idle_timeout_s: float
    max_lifetime_s: float
    paused_retention_s: float
    network_ceiling: NetworkPolicy
    network_default: NetworkPolicy
    egress_max_bytes_per_session: int
    public_url: str | None
    tool_output_max_chars: int
    ports_domain: str | None


class VolumesSection(Section):
    """Volumes: where they live, how large, how many (docs/volumes.md)."""

    volumes_dir: Path  # derived: `<state_dir>/volumes` unless set
    volume_images: bool  # derived: not in a cluster (no image on a shared directory)
    volume_default_size_mb: int
    volume_max_size_mb: int
    max_volume_bytes_per_key: int
    max_volumes_per_key: int


class Sections(BaseModel):
    """Every part's section, cut once from the settings by the composition root."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    sessions: SessionTableSection
    cluster: ClusterSection
    auth: AuthSection
    audit: AuditSection
    approvals: ApprovalSection
    admission: AdmissionSection
    expiry: ExpirySection
    storage: StorageSection
    egress: EgressSection
    ports: PortsSection
    channels: ChannelSection
    views: ViewSection
    volumes: VolumesSection

    @classmethod
    def of(cls, settings: Any, service_endpoints: tuple[ServiceEndpoint, ...]) -> Sections:
        """`service_endpoints`: what no sandbox may reach (orchestrator/service_endpoints.py)."""
        return cls(
            sessions=SessionTableSection.of(settings),
            cluster=ClusterSection.of(settings),
            auth=AuthSection.of(settings),
            audit=AuditSection.of(settings),
            approvals=ApprovalSection.of(settings),
            admission=AdmissionSection.of(settings),
            expiry=ExpirySection.of(settings),
            storage=StorageSection.of(settings),
            egress=EgressSection.of(settings, service_endpoints=service_endpoints),
            ports=PortsSection.of(settings),
            channels=ChannelSection.of(settings),
            views=ViewSection.of(settings),
            volumes=VolumesSection.of(
                settings,
                volumes_dir=settings.volumes_dir or settings.state_dir / "volumes",
                volume_images=settings.store_url is None,
            ),
        )
