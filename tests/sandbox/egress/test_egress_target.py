"""Reading where a proxy request goes: CONNECT authorities, absolute URLs, Host headers."""

from __future__ import annotations

import pytest

from sandbox.egress.target import (
    BadTarget,
    Target,
    host_header_mismatch,
    parse_absolute,
    parse_connect,
    split_authority,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pypi.org:443", ("pypi.org", 443)),
        ("PyPI.ORG.:443", ("pypi.org", 443)),
        ("[2001:db8::1]:8443", ("2001:db8::1", 8443)),
        ("[::ffff:127.0.0.1]:80", ("::ffff:7f00:1", 80)),
        ("bücher.example", ("xn--bcher-kva.example", None)),
        ("10.0.0.1", ("10.0.0.1", None)),
    ],
)
def test_split_authority(text: str, expected: tuple[str, int | None]) -> None:
    assert split_authority(text) == expected


@pytest.mark.parametrize(
    "text", ["[::1", "[::1]x", "::1:443", "host:", "host:99999", "host:0", "host:-1", "a b:80"]
)
def test_unreadable_authorities_are_refused(text: str) -> None:
    with pytest.raises(BadTarget):
        split_authority(text)


def test_connect_needs_a_port() -> None:
    assert parse_connect(b"pypi.org:443") == Target("pypi.org", 443, "")
    with pytest.raises(BadTarget, match="needs a port"):
        parse_connect(b"pypi.org")


def test_absolute_urls_become_origin_form() -> None:
    assert parse_absolute(b"http://pypi.org/simple/?x=1") == Target("pypi.org", 80, "/simple/?x=1")
    assert parse_absolute(b"HTTP://h.test:8080") == Target("h.test", 8080, "/")


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        (b"/simple/", "this is an HTTP proxy"),
        (b"*", "this is an HTTP proxy"),
        (b"https://pypi.org/", "CONNECT"),
        (b"ftp://pypi.org/", "only http://"),
        (b"http://user:pw@pypi.org/", "user names or passwords"),
        (b"http:///path", "has no host"),
        ("http://bücher.example/".encode(), "ASCII"),
    ],
)
def test_targets_the_proxy_cannot_route(raw: bytes, phrase: str) -> None:
    with pytest.raises(BadTarget, match=phrase):
        parse_absolute(raw)


def test_host_header_must_name_the_same_place() -> None:
    target = Target("pypi.org", 80, "/")
    assert host_header_mismatch(b"pypi.org", target, 80) is None
    assert host_header_mismatch(b"PYPI.org.:80", target, 80) is None
    assert host_header_mismatch(b"evil.test", target, 80) is not None
    assert host_header_mismatch(b"pypi.org:8080", target, 80) is not None
    assert host_header_mismatch(b"pypi.org:80:80", target, 80) is not None
    tunnel = Target("pypi.org", 443, "")
    assert host_header_mismatch(b"pypi.org", tunnel, 443) is None
