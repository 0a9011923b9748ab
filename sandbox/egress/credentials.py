"""Credential substitution: the sandbox holds placeholders (`cir-secret://NAME`), never the real
keys, and the egress proxy swaps a placeholder for its value in the headers of a request, only
for the hosts (and methods and path prefixes) that secret is bound to.

Why in headers only: that is where API keys travel (`Authorization`, `X-Api-Key`), and a body or
URL rewritten by the proxy would change what the sandbox's code signed or hashed. Why names and
outcomes but never values leave this module: the records and logs are shown to operators and, in
part, to the sandbox itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from code_interpreter_wire.network_policy import HostPattern, PolicyError, normalize_host

PLACEHOLDER_PREFIX = "cir-secret://"
NAME_PATTERN = r"[A-Z_][A-Z0-9_]{0,63}"
_NAME = re.compile(rf"^{NAME_PATTERN}\Z")
# The exact token: a longer name (or one running on in name characters) is not this one.
_PLACEHOLDER = re.compile(rb"cir-secret://(" + NAME_PATTERN.encode() + rb")(?![A-Za-z0-9_])")
# Printable ASCII and inner spaces only: CR, LF and NUL would let a value inject headers, and h11
# refuses other control characters and edge whitespace (with the value in its message).
_VALUE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?\Z")
# A path whose segments a server may resolve elsewhere (`/v1/../admin`, `%2e%2e`, `%2f`) never
# counts as under a prefix.
_TRICKY_PATH = re.compile(r"(^|/)\.{1,2}(/|$)|%2e|%2f|%5c|\\", re.IGNORECASE)

SUBSTITUTED = "substituted"
HOST_NOT_BOUND = "sent unchanged: host not bound"
METHOD_NOT_BOUND = "sent unchanged: method not bound"
PATH_NOT_BOUND = "sent unchanged: path not bound"
# Never swapped into plain HTTP: anyone on the way (or who spoofs the name) would read it.
PLAIN_HTTP = "sent unchanged: plain HTTP (secrets go only over HTTPS)"
UNKNOWN_NAME = "sent unchanged: no such secret"
# Names of no secret noted per request, at most: a request head full of made-up placeholders
# must not grow the session's records (or its log line) without bound.
MAX_UNKNOWN_NOTED = 16

Headers = list[tuple[bytes, bytes]]


def placeholder(name: str) -> str:
    """What the sandbox is given in place of the secret `name`."""
    if not _NAME.match(name):
        raise ValueError(f"{name[:80]!r} is not a secret name ({NAME_PATTERN})")
    return PLACEHOLDER_PREFIX + name


class SecretValue:
    """A secret's value, which no repr, str or format of it shows."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value.encode("ascii")

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "SecretValue('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretValue) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class CredentialBinding:
    """One secret: its name, its value, and where the proxy may put the value.

    `hosts` are host patterns as a network policy writes them (`api.openai.com`,
    `*.example.com`, `203.0.113.7`), without ports; `methods` and `path_prefixes`, when given,
    narrow it further (a request must match one of each)."""

    name: str
    value: SecretValue = field(repr=False)
    hosts: tuple[str, ...]
    methods: tuple[str, ...] | None = None
    path_prefixes: tuple[str, ...] | None = None
    patterns: tuple[HostPattern, ...] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        name: str,
        value: str | SecretValue,
        hosts: Iterable[str],
        methods: Iterable[str] | None = None,
        path_prefixes: Iterable[str] | None = None,
    ) -> None:
        placeholder(name)  # checks the name
        secret = value if isinstance(value, SecretValue) else _checked_value(name, value)
        host_list = tuple(hosts)
        if not host_list:
            raise ValueError(f"secret {name}: bind it to at least one host")
        patterns = []
        for host in host_list:
            try:
                pattern = HostPattern.parse(host)
            except PolicyError as exc:
                raise ValueError(f"secret {name}: {exc}") from None
            if pattern.text == "*":
                raise ValueError(f"secret {name}: '*' would send it to every host; name them")
            patterns.append(pattern)
        method_list = None if methods is None else tuple(m.upper() for m in methods)
        prefix_list = None if path_prefixes is None else tuple(path_prefixes)
        if prefix_list is not None and not all(p.startswith("/") for p in prefix_list):
            raise ValueError(f"secret {name}: path prefixes start with '/'")
        for attribute, content in (
            ("name", name),
            ("value", secret),
            ("hosts", host_list),
            ("methods", method_list),
            ("path_prefixes", prefix_list),
            ("patterns", tuple(patterns)),
        ):
            object.__setattr__(self, attribute, content)

    def covers_host(self, host: str) -> bool:
        """Whether a normalized destination host is one this secret may go to."""
        return any(pattern.matches(host) for pattern in self.patterns)

    def refusal(self, host: str, method: str, path: str) -> str | None:
        """Why this secret may not go in this request (an outcome), or None when it may."""
        if not self.covers_host(host):
            return HOST_NOT_BOUND
        if self.methods is not None and method.upper() not in self.methods:
            return METHOD_NOT_BOUND
        if self.path_prefixes is not None:
            bare = path.split("?", 1)[0].split("#", 1)[0]
            if _TRICKY_PATH.search(bare) or not any(
                bare.startswith(prefix) for prefix in self.path_prefixes
            ):
                return PATH_NOT_BOUND
        return None


def _checked_value(name: str, value: str) -> SecretValue:
    if not _VALUE.match(value):
        # The value itself is never in the message.
        raise ValueError(
            f"secret {name}: its value must be printable ASCII with no CR, LF, NUL or other "
            "control character and no leading or trailing whitespace (it goes into a header)"
        )
    return SecretValue(value)


@dataclass(frozen=True)
class Substitution:
    """A request's headers after substitution, and what happened to each placeholder name."""

    headers: Headers
    outcomes: tuple[tuple[str, str], ...]  # (name, outcome), each name once, as first seen

    @property
    def substituted(self) -> bool:
        return any(outcome == SUBSTITUTED for _, outcome in self.outcomes)


class CredentialBindings:
    """The secrets of one session."""

    def __init__(self, bindings: Iterable[CredentialBinding] = ()) -> None:
        self._by_name: dict[str, CredentialBinding] = {}
        for binding in bindings:
            if binding.name in self._by_name:
                raise ValueError(f"secret {binding.name} is bound twice; give it one binding")
            self._by_name[binding.name] = binding

    def __repr__(self) -> str:
        return f"CredentialBindings({sorted(self._by_name)!r})"

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def placeholder(self, name: str) -> str:
        """The placeholder to give the sandbox for `name` (e.g. as an environment variable)."""
        if name not in self._by_name:
            raise KeyError(name)
        return placeholder(name)

    def placeholders(self) -> dict[str, str]:
        """Every secret's placeholder by name: what the sandbox's environment may hold."""
        return {name: placeholder(name) for name in self._by_name}

    def binds(self, host: str) -> bool:
        """Whether any secret may go to `host`: then its CONNECTs are TLS-terminated."""
        try:
            normalized = normalize_host(host)
        except PolicyError:
            return False
        return any(b.covers_host(normalized) for b in self._by_name.values())

    def substitute(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        *,
        host: str,
        method: str,
        path: str,
        tls: bool = True,
    ) -> Substitution:
        """`headers` with each placeholder that may go to (host, method, path) replaced by its
        value; the others are left as they are. `host` is normalized; `path` is the request's
        origin-form target; `tls`: the request goes over TLS (else nothing is swapped, and what
        would have been is noted PLAIN_HTTP)."""
        outcomes: dict[str, str] = {}
        unknown = 0

        def replace(match: re.Match[bytes]) -> bytes:
            nonlocal unknown
            name = match.group(1).decode("ascii")
            binding = self._by_name.get(name)
            if binding is None:
                if name not in outcomes and unknown < MAX_UNKNOWN_NOTED:
                    unknown += 1
                    outcomes[name] = UNKNOWN_NAME
                return match.group(0)
            why = binding.refusal(host, method, path)
            if why is None and not tls:
                why = PLAIN_HTTP
            outcomes.setdefault(name, why or SUBSTITUTED)
            return match.group(0) if why is not None else binding.value.reveal()

        result: Headers = []
        for name, value in headers:
            if b"cir-secret://" in value:
                value = _PLACEHOLDER.sub(replace, value)
            result.append((name, value))
        return Substitution(result, tuple(outcomes.items()))
