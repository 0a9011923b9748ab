"""The deployment's CA, which the egress proxy signs its certificates for bound hosts with, and
the bundle a sandbox with secrets trusts: the host's system CAs plus this one (so its HTTPS to
every other host still verifies as before).

On one machine it is made once into the state dir (`vault-ca.crt`, `vault-ca.key` with mode
0600) and loaded at each start; in a cluster it is read from files every replica shares
(`vault_ca_cert_file`, `vault_ca_key_file`). The key never leaves the host: a sandbox gets the
certificate only."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

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


@dataclass(frozen=True)
class DeploymentCa:
    cert_pem: bytes
    key_pem: bytes
    bundle: bytes  # the system's CAs, then this one: what a sandbox with secrets trusts


def system_bundle() -> bytes:
    """The host's CA bundle, or nothing where it has none of the usual ones."""
    for path in SYSTEM_BUNDLES:
        if path.is_file():
            return path.read_bytes()
    return b""


def _write(path: Path, data: bytes, mode: int) -> None:
    """Written whole under a temporary name, then renamed: a reader never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    partial.chmod(mode)
    partial.replace(path)


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
            _write(key_path, made.key_pem, 0o600)  # the key first: a cert alone is never left
            _write(cert_path, made.cert_pem, 0o644)
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
    _write(state_dir / BUNDLE_FILE, bundle, 0o644)
    return DeploymentCa(cert_pem, key_pem, bundle)
