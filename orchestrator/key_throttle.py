"""Throttling of key guessing: wrong keys are counted per client address and per key prefix,
and an address over its budget is answered 429 with `Retry-After` before its key is checked.

Only wrong keys count. A request without a key, or with a right one, costs nothing, and an
address that sent no wrong key within the last minute is not looked up in the limiter at all:
its key is checked, and a right one let in, at once. The per-prefix budget (the first
`PREFIX_CHARS` characters a key starts with) slows a guesser that spreads its tries at one key
over many addresses; it refuses only addresses that sent a wrong key themselves within the
minute, so the key's owner is never locked out by what others guess. An IPv6 client is counted
by its /64 (one machine is commonly given a whole /64); behind a reverse proxy the address is
the one the proxies named in the `forwarded_allow_ips` setting give in `X-Forwarded-For`.

Counting is `limits` (PyPI; the library slowapi and Flask-Limiter count with), its
sliding-window counter in its in-memory storage: two integers per counted name, and a guesser
over budget regains about one try each minute/budget, not a whole budget at once at a window's
edge. That storage expires a counter once its window is over but has no cap of its own: names
come as fast as new addresses send wrong keys. So the names being counted are kept here too,
the longest quiet first, at most `max_tracked` of each kind: one more forgets (and clears) the
longest quiet, which then starts again from nothing, no better off than a guesser with a fresh
address. Memory stays bounded whatever the flood.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # the budgets are per minute
PREFIX_CHARS = 8  # "cir_" (or "e2b_") and 4 characters of a key the CLI made
UNKNOWN_ADDRESS = "unknown"  # a client the server names no address of (a Unix socket's)
_IPV6_GROUP = 64  # the prefix length an IPv6 client is counted by


class TooManyWrongKeys(Exception):
    """Refused unchecked: this address (or this key's prefix, from an address that also sent
    wrong keys) is over its budget of wrong keys. `retry_after_s`: when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Seen:
    last_failed: float  # time.monotonic()
    logged: float = -math.inf  # when its going over budget was last logged


class _Counted:
    """One kind of name (addresses, or key prefixes) counted by the limiter: which, the longest
    quiet first, at most `cap`; a name quiet for a whole window is forgotten."""

    def __init__(
        self, limiter: SlidingWindowCounterRateLimiter, budget: int, kind: str, cap: int
    ) -> None:
        self._limiter = limiter
        self._item = RateLimitItemPerMinute(budget, namespace=kind)
        self._cap = cap
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    @property
    def budget(self) -> int:
        return int(self._item.amount)

    def __len__(self) -> int:
        return len(self._seen)

    def recently_failed(self, name: str, now: float) -> bool:
        seen = self._seen.get(name)
        return seen is not None and now - seen.last_failed < WINDOW_S

    def over(self, name: str) -> bool:
        return not self._limiter.test(self._item, name)

    def retry_after_s(self, name: str) -> int:
        """Whole seconds until `name` may try again (at least 1)."""
        reset_at = self._limiter.get_window_stats(self._item, name).reset_time
        # The sliding window's estimate can fall a little short (a retry at the time said got
        # a second 429 of one second): a second more, so that the time said is enough.
        return max(1, math.ceil(reset_at - time.time()) + 1)

    def failed(self, name: str, now: float) -> _Seen:
        """Count one wrong key for `name`."""
        seen = self._seen.pop(name, None) or _Seen(now)
        seen.last_failed = now
        self._seen[name] = seen  # the most recent last
        self._limiter.hit(self._item, name)
        self._forget(now)
        return seen

    def _forget(self, now: float) -> None:
        """Drop (and clear from the limiter) the longest quiet names: those quiet a whole
        window, then as many more as the cap needs."""
        while self._seen:
            name, seen = next(iter(self._seen.items()))
            if len(self._seen) <= self._cap and now - seen.last_failed < WINDOW_S:
                return
            del self._seen[name]
            self._limiter.clear(self._item, name)


class KeyThrottle:
    """One per service: every front (REST, MCP, E2B's API, terminals' WebSockets, the console's
    login) counts against the same budgets. Safe to call from any thread."""

    def __init__(self, per_address: int, per_prefix: int, max_tracked: int) -> None:
        """`per_address`, `per_prefix`: wrong keys a minute; `max_tracked`: names of each
        kind counted at once (the memory bound)."""
        self.storage = MemoryStorage()
        limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._addresses = _Counted(limiter, per_address, "address", max_tracked)
        self._prefixes = _Counted(limiter, per_prefix, "prefix", max_tracked)
        self._lock = threading.Lock()

    def tracked(self) -> tuple[int, int]:
        """How many addresses and key prefixes are being counted now."""
        with self._lock:
            return len(self._addresses), len(self._prefixes)

    def before_check(self, client: str | None, key: str) -> None:
        """Raise `TooManyWrongKeys` if `key` from `client` must not be checked now."""
        address = address_of(client)
        now = time.monotonic()
        with self._lock:
            if not self._addresses.recently_failed(address, now):
                return  # a clean address: checked at once, whatever others guess
            if self._addresses.over(address):
                wait = self._addresses.retry_after_s(address)
                raise TooManyWrongKeys(
                    f"too many wrong keys from this address (at most "
                    f"{self._addresses.budget} a minute are checked): try again in {wait} s",
                    wait,
                )
            prefix = prefix_of(key)
            if self._prefixes.over(prefix):
                wait = self._prefixes.retry_after_s(prefix)
                raise TooManyWrongKeys(
                    "too many wrong keys starting like this one were tried lately, and this "
                    f"address sent wrong keys too: try again in {wait} s",
                    wait,
                )

    def failed(self, client: str | None, key: str) -> None:
        """Count a wrong key from `client`; log an address or prefix going over budget (once
        a minute each)."""
        address = address_of(client)
        now = time.monotonic()
        with self._lock:
            seen = self._addresses.failed(address, now)
            if self._addresses.over(address) and now - seen.logged >= WINDOW_S:
                seen.logged = now
                log.warning(
                    "key guessing: %s sent %d wrong keys within a minute; its next keys are "
                    "refused unchecked (429) until it slows down",
                    address,
                    self._addresses.budget,
                )
            prefix = prefix_of(key)
            seen = self._prefixes.failed(prefix, now)
            if self._prefixes.over(prefix) and now - seen.logged >= WINDOW_S:
                seen.logged = now
                log.warning(
                    "key guessing: %d wrong keys starting with the same %d characters within a "
                    "minute (the last from %s); addresses that send wrong keys are refused "
                    "them (429) until it slows down",
                    self._prefixes.budget,
                    PREFIX_CHARS,
                    address,
                )


@functools.lru_cache(maxsize=4096)  # parsed per request otherwise; bounded, as clients are not
def address_of(client: str | None) -> str:
    """The name a client address is counted by: itself, an IPv6 one's /64."""
    if not client:
        return UNKNOWN_ADDRESS
    try:
        parsed = ipaddress.ip_address(client)
    except ValueError:
        return client[:64]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, _IPV6_GROUP), strict=False))
    return str(parsed)


def prefix_of(key: str) -> str:
    return key.strip()[:PREFIX_CHARS]
