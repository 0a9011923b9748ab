"""The proxy's decision: the session's policy and the deployment's ceiling, numeric names and IP
literals refused unless an address rule allows them."""

from __future__ import annotations

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.egress.decision import decide

pytestmark = pytest.mark.unit

ANY = NetworkPolicy(mode="any")
PYPI = NetworkPolicy.model_validate(["pypi.org", "*.pythonhosted.org"])


def test_an_allowed_name_passes_both() -> None:
    decision = decide(PYPI, ANY, "files.pythonhosted.org", 443)
    assert decision.allowed and "allowed by *.pythonhosted.org" in decision.reason


def test_the_policy_refuses_with_its_own_words() -> None:
    decision = decide(PYPI, ANY, "evil.example", 443)
    assert not decision.allowed
    assert decision.reason.startswith("evil.example:443 is not in the allow-list (pypi.org:80,443")


def test_the_ceiling_refuses_what_the_policy_would_allow() -> None:
    decision = decide(ANY, PYPI, "evil.example", 443)
    assert not decision.allowed and "beyond this deployment's ceiling" in decision.reason


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "127.1", "0x7f000001"])
def test_numeric_names_are_refused_even_by_any(host: str) -> None:
    assert not decide(ANY, ANY, host, 80).allowed


@pytest.mark.parametrize("host", ["203.0.113.7", "2001:db8::1"])
def test_ip_literals_need_an_address_rule(host: str) -> None:
    assert not decide(ANY, ANY, host, 443).allowed
    star = NetworkPolicy.model_validate(["*"])
    assert not decide(star, ANY, host, 443).allowed
    by_address = NetworkPolicy.model_validate(["203.0.113.0/24", "2001:db8::/32"])
    assert decide(by_address, ANY, host, 443).allowed
    assert not decide(by_address, PYPI, host, 443).allowed  # and still within the ceiling
