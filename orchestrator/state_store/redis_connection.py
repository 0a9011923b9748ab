"""The Redis every replica shares (cluster mode), as each store kept in it uses it: one async
client with short timeouts, the key prefix, the failures every store reports alike, and the
check that the server demands a password (redis_auth.py).

Why Redis (docs/cluster.md): Ray's GCS fault tolerance needs one anyway; it outlives the head
node and every replica; a Lua script runs atomically whichever replica sends it. Every call is
awaited on the event loop with the store's timeout (`timeout_s`, 1 s by default): a hung Redis
costs those calls a timeout, never the loop (/healthz, calls on cached sessions).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import redis
import redis.asyncio
from pydantic import BaseModel, ValidationError

from orchestrator.session_error import SessionError
from orchestrator.state_store.redis_auth import (
    RISK,
    answers_without_password,
    check_store_url,
    open_server_refused,
    shown_url,
)

log = logging.getLogger(__name__)
Record = TypeVar("Record", bound=BaseModel)

PAGE = 200  # keys asked of each SCAN step, and read by each MGET
DEFAULT_TIMEOUT_S = 1.0  # a store that does not answer within this is unavailable


class StoreUnavailable(SessionError):
    """The shared store (Redis) cannot be reached or failed: nothing was changed by this call."""

    status = 503


class CorruptRecord(SessionError):
    """A value read back from the shared store is not what this service wrote there."""

    status = 500


class RedisConnection:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "cir",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        allow_unauthenticated: bool = False,
    ) -> None:
        """`url`: redis://:PASSWORD@HOST:PORT/DB. `timeout_s`: the longest any call waits for
        the server. `allow_unauthenticated`: use a Redis without a password (else
        `UnauthenticatedStore`, before connecting; see redis_auth)."""
        check_store_url(url, allow_unauthenticated=allow_unauthenticated)
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.allow_unauthenticated = allow_unauthenticated
        self.client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
            url,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers, and `UnauthenticatedStore` if it
        also answers a connection that sends no password, unless that is allowed (then said
        in the log). Checked when the service starts, and by the CLI."""
        with self.errors():
            await self.client.ping()
            if not await answers_without_password(self.url, self.timeout_s):
                return
        self.refuse_open_server()

    def refuse_open_server(self) -> None:
        """A server that answered without a password: refused, unless allowed (then logged)."""
        if not self.allow_unauthenticated:
            raise open_server_refused(self.url)
        log.warning(
            "the shared store (%s) takes connections without a password, as "
            "store_allow_unauthenticated allows: %s; only safe where nothing but the service's "
            "replicas and Ray reach it",
            shown_url(self.url),
            RISK,
        )

    def key(self, *parts: str) -> str:
        """A key under the prefix."""
        return ":".join((self.prefix, *parts))

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Redis's failures as StoreUnavailable, saying which store (never its password)."""
        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"the shared session store ({shown_url(self.url)}) failed: {exc}; try again"
            ) from None


def load(kind: type[Record], raw: bytes | None, key: str) -> Record | None:
    """A record read back, validated: None for none, CorruptRecord for what we did not write."""
    if raw is None:
        return None
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        raise CorruptRecord(
            f"the shared store holds a corrupt {kind.__name__} at {key!r}: "
            f"{exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}"
        ) from None


def text(answer: object) -> str:
    """A script's or command's answer as text (bytes from the server)."""
    return answer.decode() if isinstance(answer, bytes) else str(answer)
