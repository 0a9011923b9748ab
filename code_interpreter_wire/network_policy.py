"""What a sandbox may reach on the network: nothing (the default), an allow-list of host names and
ports, or anything; a deny-list applies on top of either of the last two.

The sandbox itself never gets a network interface but `lo`: a policy other than `none` gives it
a proxy (sandbox/egress/), which decides each connection by its host name with
`NetworkPolicy.decide`. A deployment's ceiling is a policy too: a session's policy must fit
within it (`NetworkPolicy.beyond`), and every connection must pass both.

Host patterns: an exact name (`pypi.org`), a wildcard for the names under a domain
(`*.pythonhosted.org`: `files.pythonhosted.org`, not `pythonhosted.org` itself), `*` for any
name, or an IP address or network (`203.0.113.7`, `10.0.0.0/8`), which matches only a
destination given as that literal address. Names are compared lowercased, without a trailing dot,
in their ASCII (IDNA) form. A rule's ports default to 80 and 443; `host:*` (no ports listed)
means every port.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_PORTS = (80, 443)
MAX_RULES = 256
MAX_PORTS_PER_RULE = 64
_MAX_NAME = 253
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class PolicyError(ValueError):
    """A policy or host pattern that cannot be read; the message says what to write instead."""


def normalize_host(host: str) -> str:
    """A host name as rules compare it: lowercase ASCII (IDNA), no trailing dot, no brackets
    around an IPv6 literal. `PolicyError` for what is not a host name or address."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text or len(text) > _MAX_NAME + 1:
        raise PolicyError(f"{host[:80]!r} is not a host name")
    with_address = address_of(text)
    if with_address is not None:
        return str(with_address)
    text = text.rstrip(".").lower()
    try:
        text = text.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise PolicyError(f"{host[:80]!r} is not a valid host name: {exc}") from None
    labels = text.split(".")
    if len(text) > _MAX_NAME or not all(_LABEL.match(label) for label in labels):
        raise PolicyError(
            f"{host[:80]!r} is not a host name (letters, digits, '-' and '_' in dot-separated "
            "labels)"
        )
    return text


def address_of(text: str) -> IpAddress | None:
    """The IP address `text` spells in a standard form, or None. Only the dotted-quad and IPv6
    forms count; other spellings of numbers (`2130706433`, `0x7f.1`) are caught by
    `is_numeric_name`."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_numeric_name(host: str) -> bool:
    """Whether a name looks like a number a resolver might read as an address (`2130706433`,
    `0x7f.1`, `127.1`): its last label is all digits or hex with `0x`. No real host name ends so
    (top-level domains are letters), so the proxy refuses these outright."""
    last = host.rstrip(".").rsplit(".", 1)[-1].lower()
    return last.isdigit() or (
        last.startswith("0x") and all(c in "0123456789abcdef" for c in last[2:])
    )


@dataclass(frozen=True)
class HostPattern:
    """One rule's host side, parsed."""

    text: str
    network: IpNetwork | None  # an address rule; None for a name rule

    @classmethod
    def parse(cls, pattern: str) -> HostPattern:
        text = pattern.strip().lower()
        if text == "*":
            return cls("*", None)
        if "/" in text:
            try:
                return cls(text, ipaddress.ip_network(text, strict=False))
            except ValueError:
                raise PolicyError(
                    f"{pattern[:80]!r} is not an IP network (e.g. 10.0.0.0/8)"
                ) from None
        if text.startswith("*."):
            return cls("*." + normalize_host(text[2:]), None)
        if "*" in text:
            raise PolicyError(
                f"{pattern[:80]!r}: a wildcard may only be a whole first label ('*.example.com') "
                "or '*' alone"
            )
        name = normalize_host(text)
        address = address_of(name)
        if address is not None:
            return cls(name, ipaddress.ip_network(address))
        return cls(name, None)

    def matches(self, host: str) -> bool:
        """Whether a normalized destination host falls under this pattern."""
        if self.text == "*":
            return True
        address = address_of(host)
        if self.network is not None or address is not None:
            return self.network is not None and address is not None and address in self.network
        if self.text.startswith("*."):
            return host.endswith(self.text[1:])
        return host == self.text

    def covers(self, other: HostPattern) -> bool:
        """Whether every host `other` matches, this matches too."""
        if self.text == "*":
            return True
        if other.text == "*":
            return False
        if self.network is not None or other.network is not None:
            return (
                self.network is not None
                and other.network is not None
                and other.network.version == self.network.version
                and other.network.subnet_of(self.network)  # type: ignore[arg-type]
            )
        if other.text.startswith("*."):
            return self.text.startswith("*.") and other.text[1:].endswith(self.text[1:])
        return self.matches(other.text)


class HostRule(BaseModel):
    """Hosts matching `host` on any of `ports`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(
        max_length=_MAX_NAME + 8,
        description="A name, '*.domain' for the names under it, '*' for any, or an IP address "
        "or network.",
    )
    ports: tuple[Annotated[int, Field(ge=1, le=65535)], ...] = Field(
        DEFAULT_PORTS,
        max_length=MAX_PORTS_PER_RULE,
        description="The ports it may reach; empty: every port. 80 and 443 if unset.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        """`"host"` or `"host:port"` (`"[v6]:port"` for an IPv6 address) stand for a rule."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        host, port = text, None
        if text.startswith("["):
            end = text.find("]")
            if end > 0 and text[end + 1 : end + 2] == ":":
                host, port = text[: end + 1], text[end + 2 :]
        elif text.count(":") == 1:
            host, port = text.split(":")
        if port is None:
            return {"host": host}
        if port == "*":
            return {"host": host, "ports": ()}
        if not port.isdigit():
            raise PolicyError(f"{value[:80]!r}: the port after ':' must be a number or '*'")
        return {"host": host, "ports": (int(port),)}

    @model_validator(mode="after")
    def _host_readable(self) -> Self:
        object.__setattr__(self, "host", HostPattern.parse(self.host).text)
        return self

    @property
    def pattern(self) -> HostPattern:
        return HostPattern.parse(self.host)

    def matches(self, host: str, port: int) -> bool:
        return (not self.ports or port in self.ports) and self.pattern.matches(host)

    def __str__(self) -> str:
        ports = ",".join(str(p) for p in self.ports) or "*"
        return f"{self.host}:{ports}"


def _covered_together(rule: HostRule, limits: tuple[HostRule, ...]) -> bool:
    """Whether the ceiling rules whose hosts cover `rule`'s hosts, taken together, cover its
    ports too (`pypi.org:80` and `pypi.org:443` together cover `pypi.org`)."""
    ports: set[int] = set()
    for limit in limits:
        if not limit.pattern.covers(rule.pattern):
            continue
        if not limit.ports:
            return True  # every port
        ports.update(limit.ports)
    return bool(rule.ports) and set(rule.ports) <= ports


@dataclass(frozen=True)
class Decision:
    """Whether one connection may go, and why (a sentence the sandboxed code will read)."""

    allowed: bool
    reason: str


NetworkMode = Literal["none", "allow_list", "any"]


class NetworkPolicy(BaseModel):
    """What one sandbox may reach. Written as `"none"`, `"any"`, a list of rules (an
    allow-list) or the full object."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: NetworkMode = Field(
        "none",
        description="'none': no network; 'allow_list': only the hosts and ports in `allow`; "
        "'any': every public host.",
    )
    allow: tuple[HostRule, ...] = Field(
        (), max_length=MAX_RULES, description="With 'allow_list': the hosts that may be reached."
    )
    deny: tuple[HostRule, ...] = Field(
        (),
        max_length=MAX_RULES,
        description="Hosts refused even when `allow` or 'any' admits them.",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"mode": value}
        if isinstance(value, list | tuple):
            return {"mode": "allow_list", "allow": value}
        if isinstance(value, dict) and "mode" not in value and value.get("allow"):
            return {**value, "mode": "allow_list"}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.mode == "allow_list" and not self.allow:
            raise PolicyError("an allow_list policy needs at least one rule in 'allow'")
        if self.mode != "allow_list" and self.allow:
            raise PolicyError(f"'allow' rules mean nothing with mode {self.mode!r}; use allow_list")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the sandbox gets a proxy at all."""
        return self.mode != "none"

    def decide(self, host: str, port: int) -> Decision:
        """This policy's answer for a normalized host and a port."""
        denied = next((rule for rule in self.deny if rule.matches(host, port)), None)
        if denied is not None:
            return Decision(False, f"{host}:{port} matches the deny rule {denied}")
        if self.mode == "any":
            return Decision(True, "any host is allowed")
        if self.mode == "none":
            return Decision(False, "this sandbox has no network access")
        allowed = next((rule for rule in self.allow if rule.matches(host, port)), None)
        if allowed is not None:
            return Decision(True, f"allowed by {allowed}")
        return Decision(False, f"{host}:{port} is not in the allow-list ({self.describe()})")

    def beyond(self, ceiling: NetworkPolicy) -> str | None:
        """Why this policy asks for more than `ceiling` allows, or None when it fits."""
        if self.mode == "none" or ceiling.mode == "any":
            return None
        if ceiling.mode == "none":
            return "this deployment gives sandboxes no network access"
        if self.mode == "any":
            return f"'any' is beyond this deployment's allow-list ({ceiling.describe()})"
        for rule in self.allow:
            if not _covered_together(rule, ceiling.allow):
                return f"{rule} is beyond this deployment's allow-list ({ceiling.describe()})"
        return None

    def describe(self, most: int = 8) -> str:
        """A short human form: `none`, `any`, or the first rules of the allow-list."""
        text: str
        if self.mode != "allow_list":
            text = self.mode
        else:
            shown = [str(rule) for rule in self.allow[:most]]
            more = len(self.allow) - len(shown)
            text = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
        if self.deny:
            text += f"; denied: {', '.join(str(rule) for rule in self.deny[:most])}"
        return text


NO_NETWORK = NetworkPolicy()


def policy_from_text(text: str) -> NetworkPolicy:
    """A policy as an operator writes it in one line: `none`, `any`, JSON, or comma-separated
    rules (`pypi.org:443,*.pythonhosted.org:443`) for an allow-list."""
    stripped = text.strip()
    if stripped in ("", "none", "any"):
        return NetworkPolicy.model_validate(stripped or "none")
    if stripped[0] in '{"' or stripped.startswith('["'):  # JSON; `[v6]:port` is a rule
        return NetworkPolicy.model_validate_json(stripped)
    return NetworkPolicy.model_validate([rule for rule in stripped.split(",") if rule.strip()])
