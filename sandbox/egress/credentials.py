"""Credential substitution: the sandbox holds placeholders (`cir-secret://NAME`), never the real
keys, and the egress proxy swaps a placeholder for its value in the headers of a request, only
for the hosts (and methods, path prefixes and header names) that secret is bound to.

Why in headers only: that is where API keys travel (`Authorization`, `X-Api-Key`), and a body or
URL rewritten by the proxy would change what the sandbox's code signed or hashed. Why only in the
headers a secret names: many APIs echo some request headers back (`Idempotency-Key`,
`X-Request-Id`, `Origin`, a bad `Content-Type` in a 415), which would hand the value to the
sandbox. Why names and outcomes but never values leave this module: the records and logs are
shown to operators and, in part, to the sandbox itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from code_interpreter_wire.network_policy import HostPattern, PolicyError, normalize_host
from code_interpreter_wire.secrets import (
    DEFAULT_HEADERS,
    MAX_HEADER_CHARS,
    MAX_HEADERS,
    PLACEHOLDER_PREFIX,
    SECRET_NAME,
    VALUE,
    checked_headers,
)

NAME_PATTERN = SECRET_NAME
_NAME = re.compile(rf"^{NAME_PATTERN}\Z")
# The exact token: a longer name (or one running on in name characters) is not this one.
_PLACEHOLDER = re.compile(
    re.escape(PLACEHOLDER_PREFIX.encode()) + rb"(" + NAME_PATTERN.encode() + rb")(?![A-Za-z0-9_])"
)
_PREFIX = PLACEHOLDER_PREFIX.encode()
_VALUE = VALUE  # what a header value may hold (the wire type's rule, and why)
# A path whose segments a server may resolve elsewhere never counts as under a prefix: dot
# segments (`/v1/../admin`), encoded dots, slashes and backslashes (`%2e%2e`, `%2f`, `%5c`, `\`),
# matrix parameters (`/v1/..;/admin`, `/v1;x`, `%3b`), empty segments (`/v1//admin`), and a
# double encoding (`%252e`), which a server or framework decoding twice would turn into one.
_TRICKY_PATH = re.compile(r"(^|/)\.{1,2}(/|$)|%2e|%2f|%5c|%3b|%25|%00|\\|;|//", re.IGNORECASE)

# Where a value goes when its binding does not say: the headers API keys travel in.
DEFAULT_SECRET_HEADERS = DEFAULT_HEADERS
MAX_SECRET_HEADERS = MAX_HEADERS  # header names one binding may name
MAX_HEADER_NAME_CHARS = MAX_HEADER_CHARS
# Methods never given a value, whatever a binding's `methods` says: TRACE (and IIS's TRACK) echo
# the request, headers included, back to the sandbox; CONNECT is never forwarded as a request.
NEVER_SWAPPED_METHODS = frozenset({"TRACE", "TRACK", "CONNECT"})
# Swaps per request, at most: of one name, and in all. A request head full of placeholders would
# otherwise grow into a head many times its size (the value being longer than its placeholder).
MAX_SWAPS_PER_NAME = 4
MAX_SWAPS = 16
# (name, outcome) pairs noted per request (and per connection), at most: made-up names count as
# one entry, so a head full of them cannot grow the session's records or its log lines.
MAX_OUTCOMES = 16

SUBSTITUTED = "substituted"
HOST_NOT_BOUND = "sent unchanged: host not bound"
METHOD_NOT_BOUND = "sent unchanged: method not bound"
PATH_NOT_BOUND = "sent unchanged: path not bound"
HEADER_NOT_BOUND = "sent unchanged: header not bound"
TOO_MANY_PLACEHOLDERS = "sent unchanged: too many placeholders"
# Never swapped into plain HTTP: anyone on the way (or who spoofs the name) would read it.
PLAIN_HTTP = "sent unchanged: plain HTTP (secrets go only over HTTPS)"
UNKNOWN_NAME = "sent unchanged: no such secret"
# The request was refused (431): with its values swapped in, its head would be over the limit.
HEAD_TOO_LARGE = "not sent: the request head would be too large with the value swapped in"
NOT_LISTED = "outcomes not listed (too many names)"

Headers = list[tuple[bytes, bytes]]


def placeholder(name: str) -> str:
    """What the sandbox is given in place of the secret `name`."""
    if not _NAME.match(name):
        raise ValueError(f"{name[:80]!r} is not a secret name ({NAME_PATTERN})")
    return PLACEHOLDER_PREFIX + name


class SecretValue:
    """A secret's value, which no repr, str or format of it shows, and which never pickles (a
    binding must not travel to another process or node)."""

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

    def __reduce__(self) -> NoReturn:
        raise TypeError("a secret's value is not pickled: it stays in the process that holds it")

    def __copy__(self) -> SecretValue:
        return self  # immutable: a copy is itself (and stays in this process)

    def __deepcopy__(self, memo: object) -> SecretValue:
        return self


@dataclass(frozen=True)
class CredentialBinding:
    """One secret: its name, its value, and where the proxy may put the value.

    `hosts` are host patterns as a network policy writes them (`api.openai.com`,
    `*.example.com`, `203.0.113.7`), without ports; a wildcard matches exactly one label, as in
    a certificate (`*.example.com`: `a.example.com`, not `a.b.example.com` nor `example.com`).
    `methods` and `path_prefixes`, when given, narrow it further (a request must match one of
    each; a prefix matches whole segments: `/v1` covers `/v1` and `/v1/x`, not `/v1-admin`).
    `headers`: the header names (any case) the value may go in; None: DEFAULT_SECRET_HEADERS."""

    name: str
    value: SecretValue = field(repr=False)
    hosts: tuple[str, ...]
    methods: tuple[str, ...] | None = None
    path_prefixes: tuple[str, ...] | None = None
    headers: tuple[str, ...] = DEFAULT_SECRET_HEADERS  # lowercase
    patterns: tuple[HostPattern, ...] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        name: str,
        value: str | SecretValue,
        hosts: Iterable[str],
        methods: Iterable[str] | None = None,
        path_prefixes: Iterable[str] | None = None,
        *,
        headers: Iterable[str] | None = None,
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
        header_list = DEFAULT_SECRET_HEADERS if headers is None else _checked_headers(name, headers)
        for attribute, content in (
            ("name", name),
            ("value", secret),
            ("hosts", host_list),
            ("methods", method_list),
            ("path_prefixes", prefix_list),
            ("headers", header_list),
            ("patterns", tuple(patterns)),
        ):
            object.__setattr__(self, attribute, content)

    def covers_host(self, host: str) -> bool:
        """Whether a normalized destination host is one this secret may go to."""
        return any(_binding_matches(pattern, host) for pattern in self.patterns)

    def covers_header(self, header: bytes) -> bool:
        """Whether the value may go in the header `header` (a lowercase name, as h11 gives)."""
        return header.decode("ascii", "replace") in self.headers

    def refusal(self, host: str, method: str, path: str) -> str | None:
        """Why this secret may not go in this request (an outcome), or None when it may."""
        if not self.covers_host(host):
            return HOST_NOT_BOUND
        verb = method.upper()
        if verb in NEVER_SWAPPED_METHODS or (self.methods is not None and verb not in self.methods):
            return METHOD_NOT_BOUND
        if self.path_prefixes is not None:
            bare = path.split("?", 1)[0].split("#", 1)[0]
            if _TRICKY_PATH.search(bare) or not any(
                _under(bare, prefix) for prefix in self.path_prefixes
            ):
                return PATH_NOT_BOUND
        return None


def _binding_matches(pattern: HostPattern, host: str) -> bool:
    """A binding's host match: as the network policy's, except that a wildcard stands for exactly
    one label (the policy's own `*.example.com` matches any depth, and stays so)."""
    if pattern.network is None and pattern.text.startswith("*."):
        suffix = pattern.text[1:]  # ".example.com"
        label = host[: -len(suffix)] if host.endswith(suffix) else ""
        return bool(label) and "." not in label
    return pattern.matches(host)


def _under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or below it, by whole segments (a prefix ending in `/` covers
    what is below it only)."""
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def _checked_value(name: str, value: str) -> SecretValue:
    if not _VALUE.match(value):
        # The value itself is never in the message.
        raise ValueError(
            f"secret {name}: its value must be printable ASCII with no CR, LF, NUL or other "
            "control character and no leading or trailing whitespace (it goes into a header)"
        )
    return SecretValue(value)


def _checked_headers(name: str, headers: Iterable[str]) -> tuple[str, ...]:
    """The wire type's rule (`checked_headers`), with the secret's name in a refusal."""
    listed = [headers] if isinstance(headers, str) else list(headers)  # one name given bare
    if not all(isinstance(h, str) for h in listed):
        raise ValueError(f"secret {name}: header names are text")
    if len(listed) > MAX_SECRET_HEADERS:
        raise ValueError(f"secret {name}: name at most {MAX_SECRET_HEADERS} headers")
    try:
        chosen = checked_headers(listed)
    except ValueError as exc:
        raise ValueError(f"secret {name}: {exc}") from None
    if not chosen:
        raise ValueError(f"secret {name}: name at least one header (or none, for the defaults)")
    return tuple(chosen)


@dataclass(frozen=True)
class Substitution:
    """A request's headers after substitution, and what happened to the placeholders: each
    (name, outcome) once, as first seen, at most MAX_OUTCOMES, made-up names in one entry."""

    headers: Headers = field(repr=False)
    outcomes: tuple[tuple[str, str], ...]
    swaps: int = 0  # placeholders swapped for their values

    @property
    def substituted(self) -> bool:
        return self.swaps > 0


class HeadTooLarge(Exception):
    """The request's head would be longer than the proxy's limit with its values swapped in: it
    is refused (431) whole. Sizes and names only, never a value."""

    def __init__(self, size: int, limit: int, outcomes: tuple[tuple[str, str], ...]) -> None:
        super().__init__(
            f"the request head would be {size} bytes with the secrets' values swapped in, over "
            f"the proxy's limit of {limit}"
        )
        self.size = size
        self.limit = limit
        self.outcomes = outcomes


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
        max_head_bytes: int | None = None,
        request_line_bytes: int = 0,
    ) -> Substitution:
        """`headers` with each placeholder that may go to (host, method, path, its header)
        replaced by its value, within MAX_SWAPS_PER_NAME and MAX_SWAPS; the others are left as
        they are. `host` is normalized; `path` is the request's origin-form target; `tls`: the
        request goes over TLS (else nothing is swapped, and what would have been is noted
        PLAIN_HTTP). `max_head_bytes`: the most the head (its request line taking
        `request_line_bytes`) may be once swapped; over it, HeadTooLarge, raised before any
        value is copied anywhere."""
        outcomes: dict[tuple[str, str], None] = {}
        unknown: set[str] = set()
        per_name: dict[str, int] = {}
        swaps = 0
        # First the plan: which placeholder (header index, span) gets which binding's value.
        plan: dict[int, list[tuple[int, int, CredentialBinding]]] = {}
        size = request_line_bytes + 2
        growth = 0
        for index, (header, value) in enumerate(headers):
            size += len(header) + len(value) + 4
            if _PREFIX not in value:
                continue
            for match in _PLACEHOLDER.finditer(value):
                name = match.group(1).decode("ascii")
                binding = self._by_name.get(name)
                if binding is None:
                    unknown.add(name)
                    continue
                why = binding.refusal(host, method, path)
                if why is None and not binding.covers_header(header):
                    why = HEADER_NOT_BOUND
                if why is None and not tls:
                    why = PLAIN_HTTP
                if why is None and (
                    per_name.get(name, 0) >= MAX_SWAPS_PER_NAME or swaps >= MAX_SWAPS
                ):
                    why = TOO_MANY_PLACEHOLDERS
                outcomes[(name, why or SUBSTITUTED)] = None
                if why is None:
                    per_name[name] = per_name.get(name, 0) + 1
                    swaps += 1
                    plan.setdefault(index, []).append((match.start(), match.end(), binding))
                    growth += len(binding.value.reveal()) - (match.end() - match.start())
        noted = _bounded(list(outcomes), unknown)
        if max_head_bytes is not None and plan and size + growth > max_head_bytes:
            refused = tuple(
                (name, HEAD_TOO_LARGE if why == SUBSTITUTED else why) for name, why in noted
            )
            raise HeadTooLarge(size + growth, max_head_bytes, refused)
        if not plan:
            return Substitution(list(headers), noted)
        result: Headers = []
        for index, (header, value) in enumerate(headers):
            spans = plan.get(index)
            if spans is None:
                result.append((header, value))
                continue
            pieces, at = [], 0
            for start, end, binding in spans:
                pieces += [value[at:start], binding.value.reveal()]
                at = end
            pieces.append(value[at:])
            result.append((header, b"".join(pieces)))
        return Substitution(result, noted, swaps)

    def unbound_outcomes(
        self, names: Iterable[str], more_unknown: int = 0
    ) -> tuple[tuple[str, str], ...]:
        """The outcomes of placeholders seen going, unchanged, to a host none of the session's
        secrets is bound to (an inspected tunnel): bounded as `substitute`'s are;
        `more_unknown`: further placeholders of made-up names, not named."""
        outcomes: list[tuple[str, str]] = []
        unknown: set[str] = set()
        for name in dict.fromkeys(names):
            if name in self._by_name:
                outcomes.append((name, HOST_NOT_BOUND))
            else:
                unknown.add(name)
        return _bounded(outcomes, unknown, more_unknown)


def _bounded(
    outcomes: list[tuple[str, str]], unknown: set[str], more_unknown: int = 0
) -> tuple[tuple[str, str], ...]:
    """At most MAX_OUTCOMES (name, outcome) pairs: the made-up names in one (the name itself when
    there is one), and the known ones past the room summed up in one."""
    room = MAX_OUTCOMES - (1 if unknown or more_unknown else 0)
    if len(outcomes) > room:
        hidden = {name for name, _ in outcomes[room - 1 :]}
        outcomes = [*outcomes[: room - 1], (f"<{len(hidden)} more names>", NOT_LISTED)]
    if more_unknown:
        outcomes.append((f"<more than {len(unknown)} unknown names>", UNKNOWN_NAME))
    elif len(unknown) == 1:
        outcomes.append((next(iter(unknown)), UNKNOWN_NAME))
    elif unknown:
        outcomes.append((f"<{len(unknown)} unknown names>", UNKNOWN_NAME))
    return tuple(outcomes)
