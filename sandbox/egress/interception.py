"""TLS termination for the hosts a session's secrets are bound to: the proxy answers the
sandbox's TLS with a certificate it mints for that host, signed by the deployment's own CA (which
the sandbox trusts), and speaks verified TLS to the real host itself.

Why a CA per deployment, made by `generate_ca`: a key shared between deployments (or written in
the code) would let anyone holding it read every sandbox's traffic. Why one leaf key per
interceptor and a certificate per host: minting is then a signature only, and a certificate names
one host, so it cannot be replayed for another. The TLS of sessions without secrets is never
ended here; that of sessions with secrets is, to their bound hosts (to swap a value in) and on
the inspected ports (to note a placeholder sent elsewhere: sandbox/egress/exchange.py).

Minting (a signature, and a context loaded from files: some milliseconds of CPU) runs on the
interceptor's own thread, so a session asking for host after host never holds the threads the
rest of the service waits on; and the new hosts a session may have its TLS ended for are paced
(`take`), each host counted once per session.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import secrets
import ssl
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from code_interpreter_wire.network_policy import address_of, normalize_host

ALPN = ["http/1.1"]  # the proxy speaks HTTP/1.1 only, on both sides
_CA_VALIDITY = datetime.timedelta(days=3650)
_LEAF_VALIDITY = datetime.timedelta(days=1)
_BACKDATE = datetime.timedelta(hours=1)  # a sandbox's clock a little behind still accepts it
_RENEW_BEFORE = datetime.timedelta(hours=1)  # a cached leaf this close to its end is re-minted
_MAX_CN = 64  # the most characters a commonName may have
# New hosts a session may have its TLS ended for, a minute: past it, its HTTPS to another new
# host stays opaque (inspection) or is refused 429 (a bound host) until the minute has moved.
NEW_HOSTS_PER_MINUTE = 30
_MAX_HOSTS_KEPT = 1024  # hosts remembered as a session's own (more: the oldest count again)


@dataclass(frozen=True)
class GeneratedCa:
    """A new CA: its certificate (for the sandboxes' trust store) and its key (the service's
    alone, never given to a sandbox)."""

    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return "GeneratedCa(cert_pem=..., key_pem=<hidden>)"


def generate_ca(
    common_name: str = "code-interpreter egress CA", *, validity: datetime.timedelta = _CA_VALIDITY
) -> GeneratedCa:
    """A fresh CA (an EC P-256 key and its self-signed certificate), for one deployment."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:_MAX_CN]),
            # Random, so that two deployments' CAs never share a name.
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, secrets.token_hex(8)),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return GeneratedCa(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


@dataclass(frozen=True)
class _Leaf:
    context: ssl.SSLContext
    cert: x509.Certificate
    not_after: datetime.datetime


class TlsInterceptor:
    """Mints per-host certificates under the deployment's CA and makes the TLS contexts of both
    sides of a terminated connection."""

    def __init__(
        self,
        ca_cert_pem: bytes,
        ca_key_pem: bytes,
        *,
        cache_size: int = 1024,
        leaf_validity: datetime.timedelta = _LEAF_VALIDITY,
        new_hosts_per_minute: int = NEW_HOSTS_PER_MINUTE,
    ) -> None:
        """`ca_cert_pem`/`ca_key_pem`: the deployment's CA (`generate_ca`); `cache_size`: how
        many hosts' certificates (and contexts) are kept, the least recently used dropped."""
        if cache_size < 1:
            raise ValueError("the certificate cache holds at least one host")
        self.ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
        key = serialization.load_pem_private_key(ca_key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise ValueError("the CA key must be an EC or RSA key")
        self._ca_key: CertificateIssuerPrivateKeyTypes = key
        _check_ca(self.ca_cert, key)
        self.ca_cert_pem = self.ca_cert.public_bytes(serialization.Encoding.PEM)
        self.cache_size = cache_size
        self.leaf_validity = leaf_validity
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaves: OrderedDict[str, _Leaf] = OrderedDict()
        self._clients: dict[Path | None, ssl.SSLContext] = {}
        self._lock = threading.Lock()  # contexts are made in worker threads
        self._minter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cir-egress-mint")
        self._pace = MovingWindowRateLimiter(MemoryStorage())
        self.new_hosts_per_minute = new_hosts_per_minute
        self._new_host_rate = RateLimitItemPerMinute(new_hosts_per_minute)
        self._hosts_of: dict[str, OrderedDict[str, None]] = {}  # session id -> its hosts so far

    def __repr__(self) -> str:
        subject = self.ca_cert.subject.rfc4514_string()
        return f"TlsInterceptor(ca={subject!r}, cached={len(self._leaves)})"

    @property
    def cached_hosts(self) -> tuple[str, ...]:
        """The hosts whose certificates are cached, least recently used first."""
        with self._lock:
            return tuple(self._leaves)

    def close(self) -> None:
        """Stop the minting thread once what it is making is made (nothing new is taken)."""
        self._minter.shutdown(wait=False)

    def may_take(self, session_id: str, host: str) -> bool:
        """Whether the session may have its TLS to `host` ended now: one of its hosts already,
        or room for one more in its minute. Nothing is counted (see `take`)."""
        with self._lock:
            known = host in self._hosts_of.get(session_id, ())
        return known or self._pace.test(self._new_host_rate, session_id)

    def take(self, session_id: str, host: str) -> bool:
        """Count `host` as one of the session's (once, however many connections reach it);
        False if its minute has no room left for a new one."""
        with self._lock:
            hosts = self._hosts_of.setdefault(session_id, OrderedDict())
            if host in hosts:
                hosts.move_to_end(host)
                return True
        if not self._pace.hit(self._new_host_rate, session_id):
            return False
        with self._lock:
            hosts = self._hosts_of.setdefault(session_id, OrderedDict())
            hosts[host] = None
            while len(hosts) > _MAX_HOSTS_KEPT:
                hosts.popitem(last=False)
        return True

    def forget(self, session_id: str) -> None:
        """The session's proxy is closed: its hosts and its count go."""
        with self._lock:
            self._hosts_of.pop(session_id, None)
        self._pace.clear(self._new_host_rate, session_id)

    async def context_for(self, host: str) -> ssl.SSLContext:
        """`server_context`, made on the interceptor's own thread (ConnectionError once the
        interceptor is closed)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._minter, self.server_context, host)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            raise ConnectionError("the egress proxy is closing") from None

    def certificate(self, host: str) -> x509.Certificate:
        """The certificate presented to the sandbox for `host` (minted, or from the cache)."""
        return self._leaf(host).cert

    def server_context(self, host: str) -> ssl.SSLContext:
        """The context that terminates the sandbox's TLS to `host`. Blocking (it may sign and
        load a certificate): call it from a worker thread."""
        return self._leaf(host).context

    def client_context(self, extra_ca_file: Path | None = None) -> ssl.SSLContext:
        """The context for the proxy's own TLS to the real host: the system's trust store (and
        `extra_ca_file`, for tests or an internal CA), host names checked."""
        with self._lock:
            context = self._clients.get(extra_ca_file)
            if context is None:
                context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
                if extra_ca_file is not None:
                    context.load_verify_locations(cafile=str(extra_ca_file))
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.set_alpn_protocols(ALPN)
                self._clients[extra_ca_file] = context
            return context

    def _leaf(self, host: str) -> _Leaf:
        name = normalize_host(host)
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            leaf = self._leaves.get(name)
            if leaf is not None and leaf.not_after - now > _RENEW_BEFORE:
                self._leaves.move_to_end(name)
                return leaf
        leaf = self._mint(name, now)
        with self._lock:
            self._leaves[name] = leaf
            self._leaves.move_to_end(name)
            while len(self._leaves) > self.cache_size:
                self._leaves.popitem(last=False)
        return leaf

    def _mint(self, name: str, now: datetime.datetime) -> _Leaf:
        address = address_of(name)
        alt: x509.GeneralName = (
            x509.IPAddress(ipaddress.ip_address(address))
            if address is not None
            else x509.DNSName(name)
        )
        not_after = min(now + self.leaf_validity, self.ca_cert.not_valid_after_utc)
        public = self._leaf_key.public_key()
        ca_ski = self.ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:_MAX_CN])]))
            .issuer_name(self.ca_cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        return _Leaf(self._context_for(cert), cert, not_after)

    def _context_for(self, cert: x509.Certificate) -> ssl.SSLContext:
        """A server context holding `cert` and the leaf key. `ssl` loads them from files only:
        the key is written encrypted with a one-time password, and both files are removed at
        once."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(ALPN)
        password = secrets.token_bytes(32)
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.ca_cert_pem
        key = self._leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(password),
        )
        with tempfile.TemporaryDirectory(prefix="cir-egress-tls-") as directory:
            cert_path, key_path = Path(directory, "cert.pem"), Path(directory, "key.pem")
            for path, data in ((cert_path, chain), (key_path, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
            context.load_cert_chain(str(cert_path), str(key_path), password=password)
        return context


def _check_ca(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    """Refuse a CA that clients would not accept as one, or a key that is not its key."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    except x509.ExtensionNotFound as exc:
        raise ValueError(f"the CA certificate lacks an extension a CA needs: {exc}") from None
    if not constraints.ca or not usage.key_cert_sign:
        raise ValueError("the CA certificate is not a CA's (basicConstraints CA, keyCertSign)")
    mine = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    theirs = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if mine != theirs:
        raise ValueError("the CA key is not the key of the CA certificate")
