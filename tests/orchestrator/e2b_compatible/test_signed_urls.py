"""The signature a signed file URL is checked against is the one E2B's SDK makes."""

from __future__ import annotations

import pytest
from e2b.sandbox.signature import Operation, get_signature

from orchestrator.e2b_compatible.signed_urls import signature_of

TOKEN = "t0ken-of-the-sandbox"


@pytest.mark.parametrize(
    ("path", "operation", "user", "lasts_s"),
    [
        ("/home/user/a.txt", "read", None, None),
        ("a b/ü.csv", "write", "user", 3600),
        ("x:y:z", "read", "", None),  # the separator inside a path changes nothing
    ],
)
def test_the_sdks_signature_is_ours(
    path: str, operation: Operation, user: str | None, lasts_s: int | None
) -> None:
    theirs = get_signature(path, operation, user, TOKEN, lasts_s)
    ours = signature_of(path, operation, user or "", TOKEN, theirs["expiration"])
    assert ours == theirs["signature"]
    assert signature_of(path, operation, user or "", "another", theirs["expiration"]) != ours
