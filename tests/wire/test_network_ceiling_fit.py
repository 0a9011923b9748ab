"""`NetworkPolicy.beyond`: a session's policy that asks for nothing beyond the ceiling must fit,
whichever way the operator split the ceiling into rules."""

from __future__ import annotations

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy, policy_from_text

pytestmark = pytest.mark.unit


def test_a_rule_covered_by_two_ceiling_rules_together_fits() -> None:
    """The one-line form the docs give (`pypi.org:443,...`) can name one port per rule only, so
    an operator allowing both web ports writes `pypi.org:80,pypi.org:443`; a session asking for
    `pypi.org` (80 and 443 by default) asks for exactly that, and is refused with a 400 today."""
    ceiling = policy_from_text("pypi.org:80,pypi.org:443")
    asked = NetworkPolicy.model_validate(["pypi.org"])
    assert asked.beyond(ceiling) is None


def test_a_one_line_ceiling_may_start_with_an_ipv6_rule() -> None:
    """The docs give `[2001:db8::1]:443` as a rule; as the first rule of the one-line setting it
    is read as JSON (it starts with '[') and the service refuses to start with a JSON error."""
    ceiling = policy_from_text("[2001:db8::1]:443,pypi.org:443")
    assert [str(rule) for rule in ceiling.allow] == ["2001:db8::1:443", "pypi.org:443"]
