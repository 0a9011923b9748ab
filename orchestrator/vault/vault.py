"""The vault as the service uses it: secrets stored, listed, read (their bindings, never their
values) and deleted for their key; a session's environment of placeholders checked and made;
and, for a session's egress proxy, its bindings with their values opened, and the TLS
interceptor signing with the deployment's CA. Values are never logged nor audited: events
name the secret, its hosts and what happened."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from code_interpreter_wire.network_policy import HostPattern, NetworkPolicy
from code_interpreter_wire.secrets import (
    MAX_SECRETS_PER_SESSION,
    SecretInfo,
    StoreSecretRequest,
    placeholder,
)
from orchestrator.governance.audit_kinds import SECRET_DELETED, SECRET_STORED, SECRET_USED
from orchestrator.vault.ca import load_ca
from orchestrator.vault.crypto import Sealer, load_key
from orchestrator.vault.public_suffixes import wildcard_refusal
from orchestrator.vault.records import (
    InvalidSecret,
    SecretBinding,
    SecretNotFound,
    SecretRecord,
    SecretsNotAvailable,
    VaultSettingError,
    VaultUnavailable,
)
from orchestrator.vault.store import VaultStore
from sandbox.egress.credentials import SUBSTITUTED, CredentialBinding, CredentialBindings
from sandbox.egress.interception import TlsInterceptor
from sandbox.egress_channel import EGRESS_DIR_IN_SANDBOX, proxy_environment

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)

BUNDLE_NAME = "ca-bundle.pem"  # in the session's egress directory: the system's CAs and ours
CA_NAME = "egress-ca.pem"  # ours alone (Node.js adds it to its own)
BUNDLE_IN_SANDBOX = f"{EGRESS_DIR_IN_SANDBOX}/{BUNDLE_NAME}"
CA_IN_SANDBOX = f"{EGRESS_DIR_IN_SANDBOX}/{CA_NAME}"

# Audit: (kind, owner, session id or None, status, details); never raises.
Audit = Callable[[str, str, str | None, str, dict[str, Any]], None]
# (name, outcome) pairs one `secret.used` event lists, at most (the proxy notes at most 16 per
# connection, made-up names counted as one entry): the rest are counted, not listed.
MAX_USES_AUDITED = 16


def trust_environment() -> dict[str, str]:
    """What points a sandbox's programs at the bundle that trusts the deployment's CA."""
    return {
        "SSL_CERT_FILE": BUNDLE_IN_SANDBOX,
        "REQUESTS_CA_BUNDLE": BUNDLE_IN_SANDBOX,
        "CURL_CA_BUNDLE": BUNDLE_IN_SANDBOX,
        "PIP_CERT": BUNDLE_IN_SANDBOX,
        "GIT_SSL_CAINFO": BUNDLE_IN_SANDBOX,
        "NODE_EXTRA_CA_CERTS": CA_IN_SANDBOX,
    }


def reserved_names() -> frozenset[str]:
    """Variables a sandbox needs as they are: a secret of such a name would replace them with
    its placeholder (the proxy's, the trust bundle's, the loader's and the shell's)."""
    basics = {"PATH", "HOME", "USER", "SHELL", "PWD", "LANG", "TERM", "TMPDIR", "PYTHONPATH"}
    keys = set(proxy_environment()) | set(trust_environment()) | basics
    return frozenset(k for k in keys if k.isupper())


@dataclass(frozen=True)
class VaultSection:
    """The vault's settings (orchestrator/config.py's `vault_*`)."""

    state_dir: Path
    # base64 of 32 bytes; None: the state dir's (one machine only). Never in a repr.
    key: str | None = field(repr=False)
    ca_cert_file: Path | None
    ca_key_file: Path | None
    max_secrets_per_key: int
    clustered: bool


@dataclass(frozen=True)
class TrustFiles:
    """What a sandbox trusts, public data only: the system's CAs and the deployment's CA
    (`bundle`), and the deployment's CA alone (`ca_cert`)."""

    bundle: bytes = field(repr=False)
    ca_cert: bytes = field(repr=False)

    def files(self) -> tuple[tuple[str, bytes], ...]:
        """(name in the egress directory, contents)."""
        return ((BUNDLE_NAME, self.bundle), (CA_NAME, self.ca_cert))


@dataclass(frozen=True)
class SessionSecrets:
    """What a session's egress proxy is given: its bindings (values opened) and the interceptor
    that terminates TLS for their hosts (the files its sandbox trusts are `Vault.trust`)."""

    bindings: CredentialBindings
    interceptor: TlsInterceptor


def unreachable(hosts: Sequence[str], policy: NetworkPolicy) -> list[str]:
    """The bound hosts the session's policy does not let it reach on any port: for those the
    binding would never be used (the policy decides reachability; a binding only decides
    substitution)."""
    missing = []
    for host in hosts:
        pattern = HostPattern.parse(host)
        if policy.mode == "none":
            reached = False
        elif policy.mode == "any":
            reached = True
        else:
            reached = any(rule.pattern.covers(pattern) for rule in policy.allow)
        if reached and any(not rule.ports and rule.pattern.covers(pattern) for rule in policy.deny):
            reached = False
        if not reached:
            missing.append(host)
    return missing


def info_of(record: SecretRecord) -> SecretInfo:
    return SecretInfo(
        name=record.name,
        hosts=record.hosts,
        methods=record.methods,
        path_prefixes=record.path_prefixes,
        headers=record.headers,
        placeholder=placeholder(record.name),
        created_at=datetime.fromtimestamp(record.created_at, UTC),
        updated_at=datetime.fromtimestamp(record.updated_at, UTC),
    )


class Vault:
    def __init__(
        self, settings: VaultSection, audit: Audit, shared: RedisConnection | None = None
    ) -> None:
        """`shared`: the Redis a cluster's replicas share (else SQLite in the state dir);
        opened by `start`."""
        self.settings = settings
        self._audit = audit
        self._shared = shared
        self._store: VaultStore | None = None
        self._sealer: Sealer | None = None
        self._trust: TrustFiles | None = None
        self._interceptor: TlsInterceptor | None = None
        self._unavailable: str | None = "the service is not started"

    async def start(self) -> None:
        """Open the store and load the key and the CA (made on first start on one machine). In
        a cluster without them the service runs, and each use of the vault says what to set."""
        s = self.settings
        try:
            key = load_key(s.key, s.state_dir, clustered=s.clustered)
            ca = load_ca(
                s.state_dir, cert_file=s.ca_cert_file, key_file=s.ca_key_file, clustered=s.clustered
            )
        except VaultUnavailable as exc:
            if not s.clustered:
                raise
            self._unavailable = str(exc)
            log.warning("the credential vault is off: %s", exc)
            return
        except VaultSettingError as exc:  # set, but wrong: the service does not start
            raise VaultUnavailable(str(exc)) from None
        self._sealer = Sealer(key)
        # The interceptor holds the CA's key (loaded); the vault keeps only what is public.
        self._interceptor = TlsInterceptor(ca.cert_pem, ca.key_pem)
        self._trust = TrustFiles(ca.bundle, ca.cert_pem)
        if self._shared is not None:
            from orchestrator.vault.redis_store import RedisVault  # the [cluster] extra's

            self._store = RedisVault(self._shared)
        else:
            from orchestrator.vault.sqlite_store import SqliteVault

            self._store = SqliteVault(s.state_dir)
        self._unavailable = None

    async def close(self) -> None:
        if self._interceptor is not None:
            self._interceptor.close()
            self._interceptor = None
        if self._store is not None:
            await self._store.close()
            self._store = None

    def _opened(self) -> tuple[VaultStore, Sealer]:
        if self._store is None or self._sealer is None:
            raise VaultUnavailable(f"the credential vault is not available: {self._unavailable}")
        return self._store, self._sealer

    @property
    def trust(self) -> TrustFiles | None:
        """The files sandboxes trust once the vault has its CA (else None)."""
        return self._trust

    # --- a key's secrets
    async def put(self, owner: str, request: StoreSecretRequest) -> tuple[SecretInfo, bool]:
        """Store (or replace) a secret: (its info, whether it replaced one)."""
        store, sealer = self._opened()
        if request.name in reserved_names() or request.name.startswith("LD_"):
            raise InvalidSecret(
                f"{request.name} is a variable sandboxes need as it is: name the secret otherwise"
            )
        for host in request.hosts:  # the route's body refused it already (422); others' too
            why = wildcard_refusal(host)
            if why is not None:
                raise InvalidSecret(why)
        binding = SecretBinding(
            hosts=request.hosts,
            methods=request.methods,
            path_prefixes=request.path_prefixes,
            headers=request.bound_headers,
        )
        try:  # refused now, as the proxy would refuse it when binding (never the value)
            _bound(request.name, request.value, binding)
        except ValueError as exc:
            raise InvalidSecret(str(exc)) from None
        # Sealed with its binding: each put seals again, under the binding it now has.
        nonce, ciphertext = sealer.seal(owner, request.name, binding, request.value)
        record = SecretRecord(
            owner=owner,
            name=request.name,
            **binding.model_dump(),
            nonce=nonce,
            ciphertext=ciphertext,
        )
        replaced = await store.put(record, self.settings.max_secrets_per_key)
        stored = await store.get(owner, request.name) or record
        details = {"name": request.name, "hosts": request.hosts, "replaced": replaced}
        self._audit(SECRET_STORED, owner, None, "ok", details)
        return info_of(stored), replaced

    async def list(self, owner: str) -> list[SecretInfo]:
        store, _ = self._opened()
        return [info_of(r) for r in await store.owned(owner)]

    async def get(self, owner: str, name: str) -> SecretInfo:
        return info_of(await self._record(owner, name))

    async def _record(self, owner: str, name: str) -> SecretRecord:
        store, _ = self._opened()
        record = await store.get(owner, name)
        if record is None:
            raise SecretNotFound(f"no secret named {name[:80]!r} for this key")
        return record

    async def delete(self, owner: str, name: str) -> None:
        store, _ = self._opened()
        if not await store.delete(owner, name):
            raise SecretNotFound(f"no secret named {name[:80]!r} for this key")
        self._audit(SECRET_DELETED, owner, None, "ok", {"name": name})

    # --- sessions
    async def session_env(
        self, owner: str, names: Sequence[str], policy: NetworkPolicy
    ) -> dict[str, str]:
        """The environment a new session asking for `names` gets: a placeholder per name and
        the trust variables. SecretsNotAvailable naming what is wrong: names this key has no
        secret of, hosts the session's network policy does not reach."""
        if len(names) > MAX_SECRETS_PER_SESSION:
            raise SecretsNotAvailable(
                f"a session may ask for at most {MAX_SECRETS_PER_SESSION} secrets"
            )
        store, sealer = self._opened()
        records = {name: await store.get(owner, name) for name in dict.fromkeys(names)}
        unknown = [name for name, record in records.items() if record is None]
        if unknown:
            raise SecretsNotAvailable(
                f"no secret of this key named {', '.join(n[:80] for n in unknown)}: store it "
                "with POST /v1/secrets first"
            )
        if not policy.enabled:
            raise SecretsNotAvailable(
                "secrets need a network: give the session a network policy that allows the "
                "hosts they are bound to (the policy decides what is reached; a secret only "
                "what is sent)"
            )
        for name, record in records.items():
            assert record is not None
            try:  # a secret that no longer opens is refused now, not left unbound silently
                sealer.open(owner, name, record.binding, record.nonce, record.ciphertext)
            except VaultUnavailable as exc:
                raise SecretsNotAvailable(str(exc)) from None
            missing = unreachable(record.hosts, policy)
            if missing:
                raise SecretsNotAvailable(
                    f"secret {name} is bound to {', '.join(missing)}, which this session's "
                    f"network policy ({policy.describe()}) does not reach: allow them in "
                    "`network` (the policy decides what is reached; a secret only what is sent)"
                )
        return {name: placeholder(name) for name in records} | trust_environment()

    async def for_session(
        self, owner: str, session_id: str, names: Sequence[str]
    ) -> SessionSecrets:
        """A session's bindings, values opened, for its egress proxy (on create and on each
        resume: bound by name, as the key's secrets are now). A name deleted since, or one that
        no longer opens (the vault key changed, its record changed at rest), is left unbound
        with a warning naming it: its placeholder then goes out unchanged."""
        store, sealer = self._opened()
        assert self._interceptor is not None
        bindings = []
        for name in dict.fromkeys(names):
            record = await store.get(owner, name)
            if record is None:
                log.warning("session %s: its secret %s is gone; left unbound", session_id, name)
                continue
            try:
                value = sealer.open(owner, name, record.binding, record.nonce, record.ciphertext)
                bindings.append(_bound(name, value, record.binding))
            except (VaultUnavailable, ValueError) as exc:
                log.warning("session %s: %s; left unbound", session_id, exc)
                continue
        return SessionSecrets(CredentialBindings(bindings), self._interceptor)

    def used(
        self, owner: str, session_id: str, host: str | None, outcomes: Sequence[tuple[str, str]]
    ) -> None:
        """A connection of a session carried placeholders: one event for the connection, its
        (name, outcome) pairs listed up to MAX_USES_AUDITED (the rest counted), status
        `substituted` when any was."""
        listed = [{"name": name, "outcome": outcome} for name, outcome in outcomes]
        details: dict[str, Any] = {"host": host, "secrets": listed[:MAX_USES_AUDITED]}
        if len(listed) > MAX_USES_AUDITED:
            details["more"] = len(listed) - MAX_USES_AUDITED
        substituted = any(outcome == SUBSTITUTED for _, outcome in outcomes)
        status = "substituted" if substituted else "unchanged"
        self._audit(SECRET_USED, owner, session_id, status, details)


def _bound(name: str, value: str, binding: SecretBinding) -> CredentialBinding:
    """The proxy's binding of a secret (ValueError as the proxy would refuse it)."""
    return CredentialBinding(
        name,
        value,
        binding.hosts,
        binding.methods,
        binding.path_prefixes,
        headers=binding.headers,
    )
