"""The service's settings: environment variables (CODE_INTERPRETER_*) and an optional TOML file.

CODE_INTERPRETER_API_KEYS=key-one,key-two
CODE_INTERPRETER_CONFIG=/etc/code-interpreter.toml   # optional; the environment wins
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from code_interpreter_wire.network_policy import (
    NO_NETWORK,
    NetworkPolicy,
    normalize_host,
    policy_from_text,
)
from code_interpreter_wire.spec import ResourceLimits
from orchestrator.host_tools.settings import HostToolsSettings
from orchestrator.state_store.redis_auth import check_store_url
from sandbox.egress.private_hosts import parse_private_hosts
from sandbox.preload import check_module_names
from sandbox.state_dir import default_state_dir

# What a Docker session may ask to run under unless the operator says otherwise: the engine's
# usual runtime and gVisor (offered only where the engine has it registered).
DEFAULT_DOCKER_RUNTIMES = ("runc", "runsc")


class Settings(BaseSettings):
    # Errors never repeat the input: it holds secrets (API keys, the store's password).
    model_config = SettingsConfigDict(
        env_prefix="CODE_INTERPRETER_", extra="forbid", hide_input_in_errors=True
    )

    # --- access
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys (full access); comma-separated in the env. None is "
        "fine: keys with names and policies are made with `code-interpreter keys add`.",
    )
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Bearer keys that are admins (full access, and they see every key's "
        "sessions' approvals and audit events); comma-separated in the env. Keys with policies "
        "are made with `code-interpreter keys add` (docs/governance.md).",
    )
    auth_disabled: bool = Field(
        False, description="Serve without keys. Only for a single user on a trusted machine."
    )
    console_secret: SecretStr | None = Field(
        None,
        description="Signs the web console's logins (at least 32 characters). Unset: a secret "
        "made in the state dir (`console-secret`). Give every replica of a cluster the same, so "
        "a login made on one holds on the others; change it to log everyone out.",
    )
    auth_failures_per_minute: int = Field(
        20,
        ge=1,
        description="Wrong keys one client address may send a minute (an IPv6 one: its /64); "
        "past that its keys are answered 429 with Retry-After, unchecked, until it slows down. "
        "A right key from an address that sends no wrong ones is never held back.",
    )
    auth_failures_per_minute_per_key_prefix: int = Field(
        100,
        ge=1,
        description="Wrong keys starting with the same 8 characters a minute, from every "
        "address: past that, addresses that sent wrong keys themselves are answered 429 for "
        "such keys (the key's owner, sending none, is let in).",
    )
    auth_throttle_max_tracked: int = Field(
        10_000,
        ge=100,
        le=1_000_000,
        description="Client addresses (and as many key prefixes) whose wrong keys are counted "
        "at once: the memory bound; the longest quiet is forgotten first.",
    )

    # --- backends and sessions
    backends: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["local"], description="Backends sessions may use."
    )
    default_backend: str = "local"
    docker_image: str = "code-interpreter-kernel:latest"
    docker_images: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Images a session may ask for; by default docker_image and the full image "
        "(every language, code-interpreter-kernel-full:latest).",
    )
    docker_templates: bool = Field(
        True,
        description="Templates (`code-interpreter template build`: images an operator built "
        "from a Dockerfile on a kernel image) may be asked for by name, beside docker_images.",
    )
    docker_runtime: str | None = Field(
        None,
        description="The OCI runtime of Docker sessions that ask for none: `runsc` runs every "
        "one under gVisor (docs/gvisor.md); unset, the engine's default (runc).",
    )
    gvisor_root: bool = Field(
        True,
        description="Processes of a gvisor-backend session may run as its machine's root (sudo, "
        "`user: root`; gVisor is the wall, docs/gvisor.md). False: refused there too, saying "
        "so.",
    )
    microvm_root: bool = Field(
        True,
        description="Processes of a microvm-backend session may run as its machine's root "
        "(the virtual machine is the wall, docs/microvm.md). False: refused there too.",
    )
    microvm_accelerator: Literal["auto", "kvm", "tcg"] = Field(
        "auto",
        description="How microvm guests run: `auto` (KVM where a guest boots on it, else "
        "TCG, QEMU's emulated CPU: docs/microvm.md), `kvm` or `tcg`.",
    )
    microvm_kernel_dir: Path | None = Field(
        None,
        description="Where the microvm guests' kernel was fetched (`python -m "
        "sandbox.backends.microvm.guest_kernel DIR`); unset, the user's cache.",
    )
    microvm_templates: bool = Field(
        True,
        description="microvm sessions are restored from a saved machine of their spec with the "
        "preload's modules imported, made in the background after the first one.",
    )
    wasm_pyodide_dir: Path | None = Field(
        None,
        description="The Pyodide distribution wasm sessions run (docs/wasm.md); unset, the "
        "pinned release `make install` fetched.",
    )
    wasm_wheels_dir: Path | None = Field(
        None,
        description="Pure-Python wheels wasm sessions may install (`await micropip.install("
        "name)`; `code-interpreter wasm fetch NAME...` downloads them into it). Unset: none.",
    )
    wasm_memory_snapshot: bool = Field(
        True,
        description="wasm sessions start from a memory snapshot of Pyodide loaded, taken once "
        "in the state directory (~0.5 s instead of ~2 s; docs/wasm.md). False: each loads cold.",
    )
    docker_runtimes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_DOCKER_RUNTIMES),
        description="Runtimes a Docker session may ask for (`runtime` on create); those the "
        "engine lacks are refused too, so the default offers runsc only where it is registered. "
        "With docker_runtime set and this unset: that runtime alone.",
    )
    orchestrator_id: str = Field("default", description="Labels this service's containers.")
    state_dir: Path = Field(default_factory=default_state_dir)
    default_limits: ResourceLimits = Field(default_factory=ResourceLimits)
    execution_timeout_s: float = Field(300.0, gt=0, description="Default time limit per call.")
    max_execution_timeout_s: float = Field(3600.0, gt=0)
    idle_timeout_s: float = Field(1200.0, gt=0, description="Idle sessions expire after this.")
    max_lifetime_s: float = Field(86400.0, gt=0, description="No session lives longer.")
    # --- pause, resume and snapshots (docs/persistence.md)
    idle_action: Literal["pause", "end"] = Field(
        "pause",
        description="What the idle expiry (and the maximum lifetime) does to a session: `pause` "
        "saves its variables and files and stops its sandbox (the next call resumes it); `end` "
        "deletes it.",
    )
    pause_on_shutdown: bool = Field(
        True,
        description="On a graceful shutdown, pause the running sessions (when idle_action is "
        "`pause`) so that a restart finds them whole; else they end.",
    )
    shutdown_pause_timeout_s: float = Field(
        120.0, gt=0, description="How long a shutdown waits for each session's pause."
    )
    paused_retention_s: float = Field(
        7 * 86400.0, gt=0, description="Paused sessions are deleted for good after this long."
    )
    max_paused_sessions_per_key: int = Field(100, ge=0)
    max_snapshots_per_key: int = Field(50, ge=0, description="Named snapshots each key may keep.")
    max_saved_bytes_per_key: int = Field(
        20 << 30, ge=0, description="Bytes of snapshots and paused sessions' states per key."
    )
    max_saved_state_bytes: int = Field(
        4 << 30, ge=1 << 20, description="The most one snapshot or paused state may hold."
    )
    saved_states_dir: Path | None = Field(
        None,
        description="A directory for saved states (snapshots, paused sessions), kept in its "
        "subdirectory `code-interpreter-saved-states/`; by default `<state_dir>/snapshots`. In "
        "cluster mode, one every replica mounts (a shared volume, NFS): with it, sessions any "
        "replica serves (the ray backend's) pause, resume on any node, snapshot and fork; "
        "without it they cannot (docs/cluster.md).",
    )
    volumes_dir: Path | None = Field(
        None,
        description="Where volumes live (docs/volumes.md); by default `<state_dir>/volumes`. In "
        "cluster mode, a directory every node mounts at the same path.",
    )
    volume_default_size_mb: int = Field(
        1024, ge=1, description="A volume's size (its quota) when its creator gives none."
    )
    volume_max_size_mb: int = Field(16384, ge=1, description="The largest volume one may make.")
    max_volume_bytes_per_key: int = Field(
        50 << 30, ge=0, description="The sizes of a key's volumes, together."
    )
    max_volumes_per_key: int = Field(100, ge=0, description="Volumes a key may hold.")
    max_sessions_per_key: int = Field(20, ge=1)
    max_sessions_total: int = Field(200, ge=1)
    pool_size: int = Field(
        0, ge=0, description="Ready sandboxes kept per backend for the default spec."
    )
    preload_modules: Annotated[list[str], AfterValidator(check_module_names), NoDecode] = Field(
        default_factory=list,
        description="Modules a pool's sandboxes import before the hand-over (comma-separated).",
    )
    local_fork_kernels: bool = Field(
        True,
        description="With preload_modules, as root: the local backend forks Python's kernels "
        "from a zygote that imported those modules once, so every kernel starts with them "
        "loaded and their memory is shared (docs/security.md); off, each kernel starts "
        "afresh and its pool imports them.",
    )
    docker_fork_kernels: bool = Field(
        True,
        description="With preload_modules, as root beside the engine (runc): the docker "
        "backend forks Python's kernels of its image from a zygote that imported those "
        "modules once, in a container of that image (docs/security.md); off, each kernel "
        "starts afresh and its pool imports them.",
    )
    preload_code: str | None = Field(
        None, description="Warm-up a pool's sandboxes run after those imports (sandbox/preload.py)."
    )
    reap_interval_s: float = Field(5.0, gt=0)

    # --- cluster mode (docs/cluster.md): sessions on a Ray cluster, replicas over a shared store
    store_url: SecretStr | None = Field(
        None,
        description="Where session records live: unset, SQLite under the state dir (one "
        "service); `redis://HOST:PORT/DB`, a Redis every replica shares (cluster mode). A "
        "secret (it may hold Redis's password): never shown in a repr or an error.",
    )
    store_timeout_s: float = Field(
        1.0,
        gt=0,
        le=30,
        description="The longest a call to the shared store waits (connect and answer); a "
        "store slower than this answers 503 StoreUnavailable.",
    )
    store_prefix: str = Field(
        "cir", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Every key of the shared store."
    )
    store_allow_unauthenticated: bool = Field(
        False,
        description="Use a shared store (Redis) without a password, or one that takes "
        "connections without one: only where nothing but the replicas and Ray reach it (it "
        "holds the keys' records and the audit log). Refused otherwise; logged when used.",
    )
    ray_address: str | None = Field(
        None, description="The Ray cluster of the ray backend (HOST:PORT); unset, RAY_ADDRESS."
    )
    ray_namespace: str = Field("code-interpreter", description="Ray namespace of the sessions.")
    ray_node_ip: str | None = Field(
        None,
        description="The address this replica's Ray driver is reached at (Ray's own guess "
        "when unset).",
    )
    ray_allow_unauthenticated: bool = Field(
        False,
        description="Join a Ray cluster at a non-loopback address without RAY_AUTH_MODE=token: "
        "only on a private network nobody else reaches (docs/cluster.md, 'Securing the "
        "cluster').",
    )
    cluster_pool_size_per_node: int = Field(
        0, ge=0, description="Ready session actors kept on each node of the ray backend."
    )
    cluster_reap_batch: int = Field(
        200, ge=1, le=10_000, description="Sessions each reaper round looks at in the store."
    )
    cluster_tombstone_ttl_s: float = Field(
        86400.0, gt=0, description="How long every replica answers 410 for an ended session."
    )
    cluster_orphan_after_s: float = Field(
        600.0,
        ge=30,
        description="How long a session actor or a paused machine's image that no session "
        "record names (its replica died before recording it) is seen so before a replica ends "
        "it: longer than any creation, resume or fork takes (a whole machine's image carried "
        "in included); under 300 s only for tests.",
    )

    # --- host tools sandboxed code may call (docs/programmatic-tool-calling.md)
    host_tools: HostToolsSettings = Field(
        default_factory=HostToolsSettings,
        description="Python callables, HTTP endpoints and MCP servers; a TOML table, or JSON "
        "in the environment.",
    )

    # --- human approval of risky calls (docs/governance.md): tools marked requires_approval,
    # and what a key's policy says waits (approval_tools, approve_executions, approve_commands)
    approval_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="How long a call waits for a human's answer; no answer by then is a denial. "
        "A host tool call's wait counts against the time limit of the execution that made it "
        "(execution_timeout_s, 300 s by default): it ends a little before that limit if that "
        "comes first, so the code reads ToolDenied instead of being interrupted. A gated "
        "execution's or command's wait comes before its own time limit starts.",
    )
    approval_webhook_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Told of every approval request (a JSON POST); a JSON answer "
        '{"decision": "approve"|"deny", "reason": ...} decides it at once.',
    )
    approval_webhook_secret: SecretStr | None = Field(
        None,
        description="Signs each webhook body: header X-CIR-Signature: sha256=<HMAC-SHA256 hex>.",
    )
    approval_webhook_timeout_s: float = Field(
        5.0, gt=0, le=60, description="The longest the webhook's answer is waited for."
    )
    approval_max_pending_per_session: int = Field(
        16, ge=1, le=1000, description="Requests one session may have waiting; more are denied."
    )
    approval_max_pending_total: int = Field(
        1000, ge=1, le=100_000, description="Requests waiting on this replica; more are denied."
    )

    # --- network egress (docs/network.md): sandboxes have none unless the operator allows it
    network_ceiling: Annotated[NetworkPolicy, NoDecode] = Field(
        NO_NETWORK,
        description="The most any session may reach: `none` (the default: no network at all), "
        "`any`, or comma-separated allowed hosts (`pypi.org:443,*.pythonhosted.org:443`); "
        "a session asking beyond it is refused (400).",
    )
    network_default: Annotated[NetworkPolicy, NoDecode] = Field(
        NO_NETWORK,
        description="The policy of a session that asks for none; within the ceiling.",
    )
    network_internet: Annotated[NetworkPolicy | None, NoDecode] = Field(
        None,
        description="What 'internet access' means to clients that ask for it with a yes (E2B's "
        "allow_internet_access): by default the ceiling itself.",
    )
    egress_private_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts a sandbox may reach although they resolve to private, loopback or "
        "link-local addresses (an internal package index), each on the port named with it: "
        "comma-separated `host:port` (a bare host: ports 80 and 443). Never the service's own "
        "port or its store's, whatever the name resolves to.",
    )
    egress_resolve: Annotated[dict[str, list[str]], NoDecode] = Field(
        default_factory=dict,
        description="For tests: names the egress proxy resolves without DNS, as "
        "`name=address[|address],...`. Such a name must still be in egress_private_hosts to "
        "reach a private address.",
    )
    egress_max_bytes_per_session: int = Field(
        1 << 30, ge=1 << 16, description="Bytes a session may move through its proxy, both ways."
    )
    egress_max_connections_per_session: int = Field(
        64,
        ge=1,
        le=4096,
        description="Connections a session's proxy holds open at once; one more is answered "
        "503 and closed at once.",
    )
    egress_max_connections_total: int = Field(
        1024,
        ge=1,
        description="Connections every session's proxy together holds open at once (each holds "
        "two of the service's descriptors); one more is answered 503 and closed at once.",
    )
    egress_max_connections_per_key: int = Field(
        256,
        ge=1,
        description="Connections the sessions of one key together hold open at once through "
        "their proxies (so one key cannot hold the service's whole budget); one more is "
        "answered 503 and closed at once.",
    )
    egress_upstream_ca_file: Path | None = Field(
        None,
        description="CA certificates (PEM) the egress proxy trusts beside the system's when it "
        "speaks TLS to a host itself (credential substitution, docs/secrets.md): an internal CA.",
    )
    egress_inspected_ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode] = (
        Field(
            default_factory=lambda: [443],
            description="CONNECT ports whose TLS the proxy inspects for a session with secrets "
            "when none is bound to the host, so that a placeholder sent there is logged (and sent "
            "unchanged); comma-separated, empty for none: such tunnels then stay opaque "
            "(docs/secrets.md).",
        )
    )

    # --- the credential vault (docs/secrets.md): keys' secrets, substituted by the proxy
    vault_key: SecretStr | None = Field(
        None,
        description="The key sealing stored secrets: base64 of 32 bytes (`openssl rand -base64 "
        "32`). Unset: made once into the state dir (vault.key, mode 0600); required in cluster "
        "mode, the same on every replica.",
    )
    vault_ca_cert_file: Path | None = Field(
        None,
        description="The deployment's CA certificate (PEM) the proxy signs bound hosts' "
        "certificates with; unset: made once into the state dir. Required in cluster mode.",
    )
    vault_ca_key_file: Path | None = Field(
        None, description="Its private key (PEM); set with vault_ca_cert_file."
    )
    vault_max_secrets_per_key: int = Field(
        100, ge=1, le=10_000, description="Secrets one key may store."
    )

    # --- inbound ports (docs/ports.md): servers a session's code starts, reached through us
    ports_enabled: bool = Field(
        True,
        description="Sessions may ask for inbound ports (CreateSessionRequest.ports, E2B's "
        "get_host); false refuses them (403).",
    )
    ports_public: bool = Field(
        True,
        description="A session may make its ports public (no key or token needed); false "
        "refuses that (403) and an E2B sandbox's default is its token instead.",
    )
    ports_domain: str | None = Field(
        None,
        max_length=200,
        pattern=r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$",
        description="The domain whose `<port>-<session id>.<domain>` hosts reach sessions' "
        "ports (a wildcard DNS name for the service, E2B's scheme), with its :port if not the "
        "default; unset: such a host is routed whatever its domain, and E2B's SDK is told the "
        "host its own request named.",
    )
    ports_max_connections_per_session: int = Field(
        32,
        ge=1,
        le=4096,
        description="Connections to a session's ports open at once (each is a relay process "
        "in its sandbox); one more is refused (503).",
    )
    ports_max_connections_total: int = Field(
        512, ge=1, description="Connections to every session's ports open at once (503 past)."
    )
    ports_max_bytes_per_connection: int = Field(
        1 << 30,
        ge=1 << 16,
        description="Bytes one connection to a port may carry, both ways together; it is "
        "closed past them.",
    )
    ports_audited_per_minute: int = Field(
        120,
        ge=1,
        description="Connections to one session's ports by callers other than its owner (a "
        "public port's anyone) written to the audit log a minute; past that they are counted, "
        "and the count is written with the next one (or at the session's end).",
    )
    ports_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="How long an HTTP exchange with a port may wait for the server's next "
        "bytes; a WebSocket's messages are not timed.",
    )

    # --- files and outputs
    max_upload_bytes: int = Field(100 << 20, ge=1)
    max_request_bytes: int = Field(
        16 << 20, ge=1024, description="Largest request body other than a file upload."
    )
    max_download_bytes: int = Field(100 << 20, ge=1)
    max_json_depth: int = Field(
        64,
        ge=8,
        le=512,
        description="Deepest nesting of arrays and objects a JSON request body may have; deeper "
        "bodies are refused (400) before any parser reads them.",
    )
    output_limit_chars: int = Field(1_000_000, ge=1000, description="Kept per execution.")
    tool_output_max_chars: int = Field(
        20_000,
        ge=500,
        description="What a model is shown of one call's text; the rest is "
        "trimmed with a note and stays downloadable.",
    )
    public_url: str | None = Field(
        None, description="Base URL for artifact links; by default the request's own."
    )
    outputs_max_bytes_per_session: int = Field(
        256 << 20,
        ge=1 << 16,
        description="Kept executions and images per session; the oldest are evicted past it.",
    )
    outputs_max_bytes_total: int = Field(
        4 << 30,
        ge=1 << 16,
        description="Kept executions and images of all sessions; the oldest are evicted past it.",
    )

    # --- E2B: the e2b backend's connection, and the E2B-compatible front (docs/e2b.md)
    e2b_api_key: str | None = Field(None, description="E2B API key of the e2b backend.")
    e2b_domain: str | None = Field(None, description="A self-hosted E2B's domain.")
    e2b_api_url: str | None = Field(None, description="The E2B API's URL, if not api.<domain>.")
    e2b_sandbox_url: str | None = Field(None, description="One URL for all E2B sandbox traffic.")
    e2b_template: str = Field("code-interpreter-v1", description="Template of e2b sessions.")
    e2b_compat: bool = Field(
        True, description="Serve E2B's API, so the unmodified E2B SDK runs on these sandboxes."
    )
    e2b_honor_insecure: bool = Field(
        False,
        description="Honour E2B's `secure: false` (its v1 SDK's default): such a sandbox's code "
        "interpreter (run code, contexts) takes its public traffic without the access token, as "
        "E2B's did; E2B's v1 code interpreter sends none. Off: every sandbox wants its token, "
        "and the v1 SDK's run_code is refused.",
    )

    # --- the shell tool beside code_interpreter (tool invoke and MCP)
    shell_tool: bool = Field(
        False,
        description="Offer models a `run_command` tool: shell commands in the code tool's "
        "session and sandbox. Off unless turned on.",
    )

    # --- MCP over HTTP (/mcp)
    mcp_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="MCP connections and the sessions they made end after this long idle: "
        "one-shot clients never say goodbye.",
    )

    # --- the audit log (docs/governance.md): what ran, who asked, when
    audit_enabled: bool = Field(
        True, description="Record sessions, executions, commands, files and egress to the log."
    )
    audit_retention_s: float = Field(
        90 * 86400.0, gt=0, description="Audit events older than this are deleted."
    )
    audit_max_events: int = Field(
        10_000_000, ge=1000, description="The most events kept; the oldest go past it."
    )
    audit_queue_max: int = Field(
        10_000,
        ge=10,
        le=1_000_000,
        description="Events waiting to be written; past it they are dropped, counted, and an "
        "audit.dropped event says how many.",
    )
    audit_batch_max: int = Field(
        500, ge=1, le=10_000, description="The most events written to the store in one go."
    )
    audit_max_code_chars: int = Field(
        65_536,
        ge=256,
        le=1 << 20,
        description="Code and command lines are kept up to this many characters, marked "
        "truncated past it.",
    )
    audit_input_record_bytes: int = Field(
        4096,
        ge=64,
        le=1 << 20,
        description="What is typed into a terminal or written to a process's stdin is recorded "
        "(`process.input`) in records of at most this many bytes.",
    )
    audit_input_records_per_minute: int = Field(
        120,
        ge=1,
        le=100_000,
        description="The most `process.input` records one session makes a minute; past it, "
        "input is counted (dropped bytes), not kept.",
    )

    # --- server
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_public: bool = Field(
        False, description="Serve /metrics without a key (a scraper on a private network)."
    )
    # Every connection, keyed or not (orchestrator/connection_guard.py, docs/security.md).
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A request's line and headers must arrive whole within this of the "
        "connection's start or the previous answer's end, else 408 and the connection closes; "
        "a body gets as long for each window of its minimum rate.",
    )
    terminal_auth_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A terminal WebSocket opened without an Authorization header (a browser's) "
        "must send its key in its first frame within this (and within http_header_timeout_s); "
        "until then the server may close it to make room for others.",
    )
    http_body_min_rate: int = Field(
        1024,
        ge=1,
        description="Bytes per second a request body must average over each window of "
        "http_header_timeout_s, else the connection closes (E2B's streamed input is exempt: "
        "it may pause 120 s).",
    )
    http_write_stall_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A client that takes none of the answers piled up for it for this long "
        "(it stopped reading, or pipelines requests without reading) is cut off, keyed or "
        "not; one still reading, however slowly, is not.",
    )
    http_max_connections_per_address: int = Field(
        512,
        ge=1,
        description="Connections one client address (the TCP peer: an IPv4 address or an "
        "IPv6 /64) may hold open; more are answered 429 and closed; at most half of "
        "http_max_connections when that is lowered at start. Behind a reverse proxy every "
        "connection comes from the proxy: set it to http_max_connections there and cap per "
        "client in the proxy.",
    )
    forwarded_allow_ips: str = Field(
        "127.0.0.1,::1",
        description="Addresses (comma-separated, CIDR ranges allowed, * for any) of the reverse "
        "proxies whose X-Forwarded-For names the client: the key-guessing throttle counts that "
        "client (the connection caps count the TCP peer, the proxy itself). Behind an "
        "ingress, its pods' range; with no proxy in front, empty.",
    )
    http_max_connections: int = Field(
        4096,
        ge=1,
        description="Connections the service holds open in all; lowered at start to keep a "
        "quarter of the open-file limit for its own work. At the cap, a connection with no "
        "keyed request being served (idle, or its caller not yet proven) is closed to make "
        "room, from the address holding the most such; 503 when there is none.",
    )

    @field_validator("network_ceiling", "network_default", "network_internet", mode="before")
    @classmethod
    def _policy_text(cls, value: Any) -> Any:
        return policy_from_text(value) if isinstance(value, str) else value

    @field_validator("egress_resolve", mode="before")
    @classmethod
    def _name_addresses(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        pairs = [part.split("=", 1) for part in value.split(",") if part.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("egress_resolve is name=address[|address],...")
        return {
            name.strip(): [a.strip() for a in addresses.split("|")] for name, addresses in pairs
        }

    @field_validator(
        "api_keys",
        "admin_keys",
        "backends",
        "docker_images",
        "docker_runtimes",
        "egress_private_hosts",
        "egress_inspected_ports",
        "preload_modules",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        # No key in the settings is no error: the keys `code-interpreter keys add` makes live
        # in the state store, and the service says how to add the first (docs/governance.md).
        if self.default_backend not in self.backends:
            raise ValueError(f"default_backend {self.default_backend!r} is not in backends")
        if self.console_secret is not None and len(self.console_secret.get_secret_value()) < 32:
            raise ValueError(
                "console_secret must be at least 32 characters: make one with "
                '`python -c "import secrets; print(secrets.token_urlsafe(32))"`'
            )
        if "ray" in self.backends and self.store_url is None:
            raise ValueError(
                "the ray backend needs a shared store: set store_url "
                "(CODE_INTERPRETER_STORE_URL, or `serve --store redis://HOST:PORT/DB`); replicas "
                "keeping sessions in SQLite would not see each other's"
            )
        if self.ray_address is not None and "ray" not in self.backends:
            raise ValueError(
                f"ray_address ({self.ray_address}) is set but the ray backend is not enabled "
                f"(backends: {', '.join(self.backends)}): add ray to the backends (`serve "
                "--backend ray`), or unset ray_address (CODE_INTERPRETER_RAY_ADDRESS, "
                "--ray-address)"
            )
        if self.store_url is not None and not self.store_url.get_secret_value().startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("store_url must be redis://HOST:PORT/DB (or rediss://, unix://)")
        if self.store_url is not None:  # before anything connects: see redis_auth
            check_store_url(
                self.store_url.get_secret_value(),
                allow_unauthenticated=self.store_allow_unauthenticated,
            )
        if self.docker_runtime is not None:
            if "docker_runtimes" not in self.model_fields_set:
                # A deployment that chose a runtime keeps every session on it unless the
                # operator lists others: no client may ask its way out of gVisor.
                self.docker_runtimes = [self.docker_runtime]
            elif self.docker_runtime not in self.docker_runtimes:
                raise ValueError(
                    f"docker_runtime {self.docker_runtime!r} is not in docker_runtimes "
                    f"({', '.join(self.docker_runtimes)})"
                )
        try:  # as the proxy will read them: refused here, at start, with the setting's name
            parse_private_hosts(self.egress_private_hosts)
            for host, addresses in self.egress_resolve.items():
                normalize_host(host)
                for address in addresses:
                    ipaddress.ip_address(address)
        except ValueError as exc:
            raise ValueError(f"egress_private_hosts or egress_resolve: {exc}") from None
        for name in ("network_default", "network_internet"):
            policy = getattr(self, name)
            why = policy.beyond(self.network_ceiling) if policy is not None else None
            if why:
                raise ValueError(f"{name} is beyond network_ceiling: {why}")
        return self

    @property
    def internet_policy(self) -> NetworkPolicy:
        """What a client asking for internet access gets: `network_internet`, else the ceiling."""
        return self.network_internet if self.network_internet is not None else self.network_ceiling

    def e2b_backend_config(self) -> dict[str, object]:
        """The e2b backend's configuration; what is unset leaves E2B_* variables in force."""
        config: dict[str, object] = {
            "api_key": self.e2b_api_key,
            "domain": self.e2b_domain,
            "api_url": self.e2b_api_url,
            "sandbox_url": self.e2b_sandbox_url,
            "template": self.e2b_template,
            "orchestrator_id": self.orchestrator_id,
        }
        return {k: v for k, v in config.items() if v is not None}

    @property
    def cluster_mode(self) -> bool:
        """Records in a store every replica shares: any replica serves any session."""
        return self.store_url is not None

    def ray_backend_config(self) -> dict[str, object]:
        """The ray backend's configuration (sandbox/backends/ray_cluster)."""
        return {
            "address": self.ray_address,
            "namespace": self.ray_namespace,
            "orchestrator_id": self.orchestrator_id,
            "node_ip": self.ray_node_ip,
            "pool_size_per_node": self.cluster_pool_size_per_node,
            "allow_unauthenticated": self.ray_allow_unauthenticated,
            # The service opens each networked session's proxy on its node and audits its
            # connections (session_egress.py).
            "egress_relayed": True,
            # Paused whole machines (gVisor nodes) wait beside the saved states, where every
            # replica finds them; none without a shared saved_states_dir.
            "machine_images_dir": (
                self.saved_states_dir / "code-interpreter-paused-machines"
                if self.saved_states_dir is not None
                else None
            ),
        }

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("CODE_INTERPRETER_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)
