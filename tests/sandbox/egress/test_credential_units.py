"""Credential bindings and the TLS interceptor on their own: what a binding accepts, which
placeholders a request's headers get swapped, that a value never shows in a repr, and the
certificates minted per host under a per-deployment CA, in a bounded cache."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from sandbox.egress.credentials import (
    HEADER_NOT_BOUND,
    HOST_NOT_BOUND,
    MAX_OUTCOMES,
    METHOD_NOT_BOUND,
    PATH_NOT_BOUND,
    PLACEHOLDER_PREFIX,
    SUBSTITUTED,
    UNKNOWN_NAME,
    CredentialBinding,
    CredentialBindings,
    placeholder,
)
from sandbox.egress.interception import TlsInterceptor, generate_ca
from sandbox.egress.ledger import EgressRecord

VALUE = "sk-real-0123456789abcdef"


def bindings() -> CredentialBindings:
    return CredentialBindings(
        [
            CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test", "*.example.test")),
            CredentialBinding(
                "GH_TOKEN",
                "ghp-real-token",
                hosts=("gh.test",),
                methods=("post",),
                path_prefixes=("/v1/",),
            ),
        ]
    )


@pytest.mark.parametrize(
    "value",
    [
        "abc\r\nX-Evil: 1",
        "abc\nX-Evil: 1",
        "abc\rdef",
        "abc\x00def",
        "tab\there",
        " sk-x",
        "sk-x ",
        "x\x7f",
        "",
    ],
)
def test_a_value_with_cr_lf_nul_or_control_characters_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="control character") as caught:
        CredentialBinding("KEY", value, hosts=("api.test",))
    assert not value or value not in str(caught.value)


@pytest.mark.parametrize(
    ("name", "hosts", "why"),
    [
        ("lower", ("api.test",), "not a secret name"),
        ("1KEY", ("api.test",), "not a secret name"),
        ("A" * 65, ("api.test",), "not a secret name"),
        ("KEY", (), "at least one host"),
        ("KEY", ("*",), "every host"),
        ("KEY", ("bad host!",), "not a host name"),
    ],
)
def test_names_and_hosts_are_checked(name: str, hosts: tuple[str, ...], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        CredentialBinding(name, VALUE, hosts=hosts)


def test_a_name_bound_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="bound twice"):
        CredentialBindings(
            [
                CredentialBinding("KEY", VALUE, hosts=("a.test",)),
                CredentialBinding("KEY", VALUE, hosts=("b.test",)),
            ]
        )


def test_the_value_never_shows_in_a_repr_or_a_str() -> None:
    secrets = bindings()
    binding = CredentialBinding("OPENAI_KEY", VALUE, hosts=("api.test",))
    for text in (
        repr(binding),
        str(binding),
        repr(secrets),
        f"{binding.value}",
        repr(binding.value),
    ):
        assert VALUE not in text
    assert "OPENAI_KEY" in repr(binding)
    assert binding.value.reveal() == VALUE.encode()


def test_placeholders_and_which_hosts_are_bound() -> None:
    secrets = bindings()
    assert (
        placeholder("OPENAI_KEY") == PLACEHOLDER_PREFIX + "OPENAI_KEY" == "cir-secret://OPENAI_KEY"
    )
    assert secrets.placeholders() == {
        "OPENAI_KEY": "cir-secret://OPENAI_KEY",
        "GH_TOKEN": "cir-secret://GH_TOKEN",
    }
    # Matched as the network policy matches hosts: lowercase, no trailing dot, wildcards.
    assert secrets.binds("api.test") and secrets.binds("API.Test.")
    assert secrets.binds("x.example.test") and not secrets.binds("example.test")
    assert not secrets.binds("api.test.evil") and not secrets.binds("other.test")


def test_substitution_swaps_exact_tokens_in_bound_headers_for_bound_hosts_only() -> None:
    secrets = bindings()
    headers = [
        (b"authorization", b"Bearer cir-secret://OPENAI_KEY"),
        (b"x-api-key", b"cir-secret://OPENAI_KEY,cir-secret://OPENAI_KEY"),
        (b"x-two", b"cir-secret://OPENAI_KEY"),  # not a header the value goes in
        (b"x-longer", b"cir-secret://OPENAI_KEYS"),  # another name, not this one
        (b"x-unknown", b"cir-secret://NOT_BOUND"),
        (b"accept", b"*/*"),
    ]
    done = secrets.substitute(headers, host="api.test", method="GET", path="/")
    assert done.headers == [
        (b"authorization", f"Bearer {VALUE}".encode()),
        (b"x-api-key", f"{VALUE},{VALUE}".encode()),
        (b"x-two", b"cir-secret://OPENAI_KEY"),
        (b"x-longer", b"cir-secret://OPENAI_KEYS"),
        (b"x-unknown", b"cir-secret://NOT_BOUND"),
        (b"accept", b"*/*"),
    ]
    assert done.swaps == 3
    assert done.outcomes == (
        ("OPENAI_KEY", SUBSTITUTED),
        ("OPENAI_KEY", HEADER_NOT_BOUND),
        ("<2 unknown names>", UNKNOWN_NAME),
    )
    elsewhere = secrets.substitute(headers, host="other.test", method="GET", path="/")
    assert elsewhere.headers == headers and not elsewhere.substituted
    assert ("OPENAI_KEY", HOST_NOT_BOUND) in elsewhere.outcomes


@pytest.mark.parametrize(
    ("method", "path", "outcome"),
    [
        ("POST", "/v1/repos", SUBSTITUTED),
        ("post", "/v1/repos?x=1", SUBSTITUTED),
        ("GET", "/v1/repos", METHOD_NOT_BOUND),
        ("POST", "/v2/repos", PATH_NOT_BOUND),
        ("POST", "/v1", PATH_NOT_BOUND),
        ("POST", "/v1/../admin", PATH_NOT_BOUND),
        ("POST", "/v1/%2e%2e/admin", PATH_NOT_BOUND),
        ("POST", "/v1/..%2Fadmin", PATH_NOT_BOUND),
    ],
)
def test_methods_and_path_prefixes_narrow_a_binding(method: str, path: str, outcome: str) -> None:
    headers = [(b"authorization", b"token cir-secret://GH_TOKEN")]
    done = bindings().substitute(headers, host="gh.test", method=method, path=path)
    assert done.outcomes == (("GH_TOKEN", outcome),)
    assert (done.headers != headers) == (outcome == SUBSTITUTED)


def test_a_record_shows_names_and_outcomes_only() -> None:
    record = EgressRecord(
        time=0.0,
        host="other.test",
        port=443,
        method="GET",
        allowed=True,
        reason="allowed",
        address="127.0.0.1",
        bytes_up=1,
        bytes_down=2,
        duration_s=0.1,
        credentials=(("OPENAI_KEY", HOST_NOT_BOUND),),
    )
    line = record.describe("s-1")
    assert "credentials=[OPENAI_KEY: sent unchanged: host not bound]" in line
    plain = EgressRecord(0.0, "a.test", 80, "GET", True, "ok", None, 0, 0, 0.0)
    assert "credentials" not in plain.describe("s-1")


# ---- the interceptor ------------------------------------------------------------------------


def test_a_generated_ca_is_a_ca_and_each_is_new() -> None:
    one, two = generate_ca(), generate_ca()
    assert one.key_pem != two.key_pem and one.cert_pem != two.cert_pem
    assert b"PRIVATE KEY" not in repr(one).encode()
    cert = x509.load_pem_x509_certificate(one.cert_pem)
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert constraints.critical and constraints.value.ca
    assert usage.value.key_cert_sign and usage.critical


def test_a_minted_certificate_names_one_host_and_is_signed_by_the_ca() -> None:
    ca = generate_ca()
    interceptor = TlsInterceptor(ca.cert_pem, ca.key_pem)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    api, other, address = (
        interceptor.certificate("api.test"),
        interceptor.certificate("Other.Test."),
        interceptor.certificate("127.0.0.1"),
    )
    for cert in (api, other, address):
        cert.verify_directly_issued_by(ca_cert)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
        lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        assert lifetime <= datetime.timedelta(days=1)

    def names(cert: x509.Certificate) -> list[object]:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*alt.get_values_for_type(x509.DNSName), *alt.get_values_for_type(x509.IPAddress)]

    assert names(api) == ["api.test"]
    assert names(other) == ["other.test"]
    assert names(address) == [ipaddress.ip_address("127.0.0.1")]
    assert api.serial_number != other.serial_number
    assert interceptor.certificate("api.test") is api  # cached


def test_the_certificate_cache_is_bounded_least_recently_used_out() -> None:
    ca = generate_ca()
    interceptor = TlsInterceptor(ca.cert_pem, ca.key_pem, cache_size=2)
    first = interceptor.certificate("a.test")
    interceptor.certificate("b.test")
    interceptor.certificate("a.test")  # used again: b is now the oldest
    interceptor.certificate("c.test")
    assert interceptor.cached_hosts == ("a.test", "c.test")
    assert interceptor.certificate("a.test") is first
    assert interceptor.certificate("b.test") is not None  # minted again
    assert interceptor.cached_hosts == ("a.test", "b.test")
    for host in [f"h{i}.test" for i in range(10)]:
        interceptor.server_context(host)
    assert len(interceptor.cached_hosts) == 2


def test_an_interceptor_refuses_a_key_that_is_not_the_cas_or_a_cert_that_is_no_ca() -> None:
    one, two = generate_ca(), generate_ca()
    with pytest.raises(ValueError, match="not the key of the CA"):
        TlsInterceptor(one.cert_pem, two.key_pem)
    leaf = TlsInterceptor(one.cert_pem, one.key_pem).certificate("leaf.test")
    with pytest.raises(ValueError, match="CA"):
        TlsInterceptor(leaf.public_bytes(serialization.Encoding.PEM), one.key_pem)


def test_made_up_names_noted_are_one_entry_but_bound_ones_always_are() -> None:
    made_up = ",".join(f"cir-secret://FAKE_{i}" for i in range(100)).encode()
    headers = [(b"x-many", made_up), (b"authorization", b"Bearer cir-secret://OPENAI_KEY")]
    done = bindings().substitute(headers, host="api.test", method="GET", path="/")
    assert done.outcomes == (("OPENAI_KEY", SUBSTITUTED), ("<100 unknown names>", UNKNOWN_NAME))
    assert len(done.outcomes) <= MAX_OUTCOMES
    assert done.headers[0] == (b"x-many", made_up)
    one = bindings().substitute(
        [(b"x-one", b"cir-secret://TYPO")], host="api.test", method="GET", path="/"
    )
    assert one.outcomes == (("TYPO", UNKNOWN_NAME),)  # a single one by its name: a typo shows
