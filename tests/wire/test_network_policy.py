"""The network policy model: how rules are read, matched, and held to a ceiling."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from code_interpreter_wire.network_policy import (
    NO_NETWORK,
    NetworkPolicy,
    is_numeric_name,
    normalize_host,
    policy_from_text,
)

pytestmark = pytest.mark.unit


def test_shorthands_read_as_policies() -> None:
    assert NetworkPolicy.model_validate("none") == NO_NETWORK
    assert NetworkPolicy.model_validate("any").mode == "any"
    listed = NetworkPolicy.model_validate(["pypi.org", "*.pythonhosted.org:443", "a.test:*"])
    assert listed.mode == "allow_list"
    assert [str(r) for r in listed.allow] == [
        "pypi.org:80,443",
        "*.pythonhosted.org:443",
        "a.test:*",
    ]
    assert NetworkPolicy.model_validate({"allow": ["x.org"]}).mode == "allow_list"


@pytest.mark.parametrize(
    "bad",
    [
        {"mode": "allow_list"},  # nothing allowed
        {"mode": "any", "allow": ["x.org"]},  # rules that mean nothing
        ["exa*mple.org"],  # a wildcard inside a label
        ["x.org:http"],  # a port that is not a number
        ["x.org:70000"],
        ["-bad-.org"],
        ["a" * 300],
        [f"h{i}.org" for i in range(300)],  # past the rule cap
        {"mode": "sometimes"},
    ],
)
def test_unreadable_policies_are_refused(bad: object) -> None:
    with pytest.raises(ValidationError):
        NetworkPolicy.model_validate(bad)


def test_wildcards_match_names_under_a_domain_not_the_domain() -> None:
    policy = NetworkPolicy.model_validate(["*.pythonhosted.org:443"])
    assert policy.decide("files.pythonhosted.org", 443).allowed
    assert policy.decide("a.b.pythonhosted.org", 443).allowed
    assert not policy.decide("pythonhosted.org", 443).allowed
    assert not policy.decide("evilpythonhosted.org", 443).allowed
    assert not policy.decide("files.pythonhosted.org", 80).allowed


def test_a_refusal_names_the_policy() -> None:
    policy = NetworkPolicy.model_validate(["pypi.org:443"])
    decision = policy.decide("evil.example", 443)
    assert not decision.allowed
    assert "evil.example:443" in decision.reason and "pypi.org:443" in decision.reason


def test_deny_rules_win() -> None:
    policy = NetworkPolicy.model_validate({"mode": "any", "deny": ["*.internal.example"]})
    assert policy.decide("pypi.org", 443).allowed
    denied = policy.decide("db.internal.example", 443)
    assert not denied.allowed and "deny rule" in denied.reason


def test_address_rules_match_only_literal_addresses() -> None:
    policy = NetworkPolicy.model_validate(["203.0.113.0/24", "[2001:db8::1]:443"])
    assert policy.decide("203.0.113.9", 80).allowed
    assert not policy.decide("203.0.114.9", 80).allowed
    assert policy.decide("2001:db8::1", 443).allowed
    assert not policy.decide("example.org", 80).allowed  # a name never matches an address rule


def test_names_are_normalized() -> None:
    assert normalize_host("PyPI.org.") == "pypi.org"
    assert normalize_host("bücher.de") == "xn--bcher-kva.de"
    assert normalize_host("[::1]") == "::1"
    assert is_numeric_name("2130706433") and is_numeric_name("0x7f.1") and is_numeric_name("127.1")
    assert not is_numeric_name("pypi.org")


def test_a_policy_within_its_ceiling() -> None:
    ceiling = NetworkPolicy.model_validate(["*.org", "files.example.com:443"])
    assert NetworkPolicy.model_validate(["pypi.org:443"]).beyond(ceiling) is None
    assert NetworkPolicy.model_validate(["*.python.org"]).beyond(ceiling) is None
    assert NO_NETWORK.beyond(ceiling) is None
    assert "beyond" in (NetworkPolicy.model_validate("any").beyond(ceiling) or "")
    assert "beyond" in (NetworkPolicy.model_validate(["example.com"]).beyond(ceiling) or "")
    assert "beyond" in (NetworkPolicy.model_validate(["x.org:22"]).beyond(ceiling) or "")
    assert "beyond" in (NetworkPolicy.model_validate(["x.org:*"]).beyond(ceiling) or "")
    assert "no network" in (NetworkPolicy.model_validate(["x.org"]).beyond(NO_NETWORK) or "")
    assert NetworkPolicy.model_validate("any").beyond(NetworkPolicy.model_validate("any")) is None


def test_an_operator_writes_a_policy_on_one_line() -> None:
    assert policy_from_text("") == NO_NETWORK
    assert policy_from_text("any").mode == "any"
    assert policy_from_text("pypi.org:443, *.pythonhosted.org").allow[1].ports == (80, 443)
    assert policy_from_text('{"mode": "any", "deny": ["x.org"]}').deny[0].host == "x.org"
