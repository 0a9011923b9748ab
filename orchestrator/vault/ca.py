"""The deployment's CA, which the egress proxy signs its certificates for bound hosts with, and
the bundle a sandbox with secrets trusts: the host's system CAs plus this one (so its HTTPS to
every other host still verifies as before).

On one machine it is made once into the state dir (`vault-ca.crt`, `vault-ca.key` with mode
0600) and loaded at each start; in a cluster it is read from files every replica shares
(`vault_ca_cert_file`, `vault_ca_key_file`). The key never leaves the host: a sandbox gets the
certificate only. An expired CA stops the service from starting; one near its end, or a given
key file others may read, is warned of."""

from __future__ import annotations

import datetime
import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from orchestrator.durable_files import write_new
from orchestrator.vault.records import VaultSettingError, VaultUnavailable
from sandbox.egress.interception import generate_ca

log = logging.getLogger(__name__)
CERT_FILE = "vault-ca.crt"
KEY_FILE = "vault-ca.key"
BUNDLE_FILE = "vault-ca-bundle.pem"
SYSTEM_BUNDLES = (
    Path("/etc/ssl/certs/ca-certificates.crt"),  # Debian, Ubuntu, Alpine
    Path("/etc/pki/tls/certs/ca-bundle.crt"),  # Fedora, RHEL
)
NEAR_EXPIRY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class DeploymentCa:
    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    bundle: bytes = field(repr=False)  # the system's CAs, then this one: what sandboxes trust


def system_bundle() -> bytes:
    """The host's CA bundle, or nothing where it has none of the usual ones."""
    for path in SYSTEM_BUNDLES:
        if path.is_file():
            return path.read_bytes()
    return b""


def _checked(cert_pem: bytes, key_pem: bytes, where: str) -> None:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except ValueError as exc:
        raise VaultSettingError(f"the vault's CA at {where} cannot be read: {exc}") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        raise VaultSettingError(f"the vault's CA at {where}: its key is not its certificate's")
    _check_validity(cert, where)


def _check_validity(cert: x509.Certificate, where: str) -> None:
    """An expired CA refuses to start (every terminated connection would fail to verify); one
    ending within NEAR_EXPIRY is warned of."""
    now = datetime.datetime.now(datetime.UTC)
    ends = cert.not_valid_after_utc
    if ends <= now:
        raise VaultSettingError(
            f"the vault's CA at {where} expired on {ends:%Y-%m-%d}: give a current one "
            "(vault_ca_cert_file and vault_ca_key_file), or on one machine delete "
            "vault-ca.crt and vault-ca.key from the state dir to have a new one made"
        )
    if ends - now < NEAR_EXPIRY:
        log.warning(
            "the vault's CA at %s expires on %s: replace it before then (sessions with secrets "
            "fail to verify their bound hosts after it)",
            where,
            f"{ends:%Y-%m-%d}",
        )


def _warn_if_readable(key_file: Path) -> None:
    """A given CA key file that its group or others may read is warned of (not refused: the
    operator may have reasons, e.g. a group the service runs in)."""
    try:
        mode = key_file.stat().st_mode
    except OSError:
        return  # its read then says why
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "vault_ca_key_file %s has mode %o: its group or others may read the CA's private "
            "key, which signs certificates every sandbox with secrets trusts; chmod 600 it",
            key_file,
            stat.S_IMODE(mode),
        )


def load_ca(
    state_dir: Path,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    clustered: bool = False,
) -> DeploymentCa:
    """The deployment's CA: from `cert_file` and `key_file` when given (a cluster's shared
    ones), else the state dir's (made at first start; not in a cluster: each replica would
    make its own)."""
    if (cert_file is None) != (key_file is None):
        raise VaultSettingError("set both vault_ca_cert_file and vault_ca_key_file, or neither")
    if cert_file is not None and key_file is not None:
        _warn_if_readable(key_file)
        try:
            cert_pem, key_pem = cert_file.read_bytes(), key_file.read_bytes()
        except OSError as exc:
            raise VaultSettingError(f"the vault's CA files cannot be read: {exc}") from None
        where = str(cert_file)
    elif clustered:
        raise VaultUnavailable(
            "the credential vault needs vault_ca_cert_file and vault_ca_key_file in cluster "
            "mode (every replica must sign with one CA that sandboxes trust)"
        )
    else:
        cert_path, key_path = state_dir / CERT_FILE, state_dir / KEY_FILE
        if not (cert_path.exists() and key_path.exists()):
            state_dir.mkdir(parents=True, exist_ok=True)
            made = generate_ca("code-interpreter-runtime egress CA")
            write_new(key_path, made.key_pem, 0o600)  # the key first: a cert alone is never left
            write_new(cert_path, made.cert_pem, 0o644)
        key_path.chmod(0o600)
        cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
        where = str(cert_path)
    _checked(cert_pem, key_pem, where)
    system = system_bundle()
    if not system:
        log.warning(
            "no system CA bundle (%s): sandboxes with secrets trust the deployment's CA alone, "
            "so their HTTPS to hosts no secret is bound to fails to verify",
            ", ".join(map(str, SYSTEM_BUNDLES)),
        )
    bundle = system + (b"" if not system or system.endswith(b"\n") else b"\n") + cert_pem
    state_dir.mkdir(parents=True, exist_ok=True)
    write_new(state_dir / BUNDLE_FILE, bundle, 0o644)
    return DeploymentCa(cert_pem, key_pem, bundle)
