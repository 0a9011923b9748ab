"""The operator's private-host entries: a port each (a bare name: 80 and 443), never every
port; a bad entry is refused when the settings load, by name."""

from __future__ import annotations

import pytest

from sandbox.egress import EgressSettings
from sandbox.egress.private_hosts import PrivateHostError, parse_private_hosts

pytestmark = pytest.mark.unit


def test_entries_name_their_ports_and_a_bare_name_means_80_and_443() -> None:
    ports = parse_private_hosts(
        ["db.internal:5432", "Index.Local.", "db.internal:6543", "[fd00::1]:8080", "[fd00::2]"]
    )
    assert dict(ports) == {
        "db.internal": {5432, 6543},
        "index.local": {80, 443},
        "fd00::1": {8080},
        "fd00::2": {80, 443},
    }


@pytest.mark.parametrize(
    ("entry", "phrase"),
    [
        ("db.internal:0", "the port must be a number from 1 to 65535"),
        ("db.internal:*", "the port must be a number from 1 to 65535"),
        ("db.internal:5432:1", "write an IPv6 address in brackets"),
        # Read as the address fd00::1:8080, not fd00::1 on port 8080: brackets are required.
        ("fd00::1:8080", "an IPv6 address without brackets"),
        ("fd00::2", "an IPv6 address without brackets"),
        ("*.internal:80", "is not a host name"),
        ("", "is empty"),
    ],
)
def test_a_bad_entry_is_a_typed_error_naming_it(entry: str, phrase: str) -> None:
    with pytest.raises(PrivateHostError) as caught:
        EgressSettings(private_hosts=frozenset({entry}))
    assert phrase in str(caught.value)
    if entry:
        assert repr(entry) in str(caught.value)
