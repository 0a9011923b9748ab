"""Which domains are shared by parties who do not trust each other: public suffixes (`com`,
`co.uk`) and the domains hosting providers give their customers names under (`github.io`,
`herokuapp.com`, `blob.core.windows.net`), and the domains holding such ones (`amazonaws.com`,
above `s3.amazonaws.com`). A secret bound to `*.` one of these would go to strangers' hosts.

From the Public Suffix List, its private section included, as `publicsuffixlist` bundles it:
read from that package's file once, never fetched (keep the package current to keep the list
current).

`StoreSecretBody` is the store request as the service takes it (the route's body), so such a
wildcard is a 422 naming it; the vault checks again whatever it is handed (vault.py)."""

from __future__ import annotations

import functools

from publicsuffixlist import PSLFILE, PublicSuffixList, encode_idn
from pydantic import field_validator

from code_interpreter_wire.secrets import StoreSecretRequest


@functools.cache
def _list() -> tuple[PublicSuffixList, frozenset[str]]:
    """The list, and every domain some rule of it lies under (the rules' proper parents)."""
    suffixes = PublicSuffixList()  # unknown top-level labels count as public suffixes
    parents: set[str] = set()
    with open(PSLFILE, encoding="utf-8") as source:
        for line in source:
            rule = line.strip().split(" ")[0].lower().lstrip("!")
            if not rule or rule.startswith("//"):
                continue
            for form in {rule, encode_idn(rule)}:
                labels = form.split(".")
                parents.update(".".join(labels[i:]) for i in range(1, len(labels)))
    return suffixes, frozenset(parents)


def shared_domain(domain: str) -> str | None:
    """Why `domain` (lowercase, IDNA A-labels) is shared by other parties' hosts, or None when
    it is not (`example.com`, `api.openai.com`)."""
    suffixes, parents = _list()
    name = domain.strip(".").lower()
    if suffixes.is_public(name):
        return "a public suffix (domains of different owners are registered under it)"
    if name in parents:
        return "a domain under which others' domains are registered (a hosting provider's)"
    return None


def wildcard_refusal(host: str) -> str | None:
    """Why the binding's host pattern `host` (normalized) is refused, or None: `*.base` over a
    shared domain."""
    if not host.startswith("*."):
        return None
    base = host[2:]
    why = shared_domain(base)
    if why is None:
        return None
    return (
        f"{host!r}: {base} is {why}, so the wildcard would reach other parties' hosts; name "
        "the hosts the secret is for"
    )


class StoreSecretBody(StoreSecretRequest):
    """`StoreSecretRequest` as the service takes it: no wildcard over a shared domain."""

    @field_validator("hosts")
    @classmethod
    def _own_domains(cls, hosts: list[str]) -> list[str]:
        for host in hosts:  # already normalized by StoreSecretRequest's own validator
            why = wildcard_refusal(host)
            if why is not None:
                raise ValueError(why)
        return hosts
