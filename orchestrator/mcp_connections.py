"""MCP connections over streamable HTTP (the `Mcp-Session-Id` of protocol versions with a
handshake): whose each is, what its client said when it opened it (its `initialize` params), and
which session of ours it uses.

On one machine they are kept in this process. In cluster mode they are kept in the Redis every
replica shares (`SharedMcpConnections`), so a connection opened through one replica is continued
through any other (mcp_front/adoption.py): no sticky routing. An ended connection leaves a mark
there, so a replica still holding it refuses it too. An entry lives `keep_s` after the start and
the end of the last request on it: the connection's idle timeout plus the longest a call may
run, so a long call never outlives its connection's entry (the connection and the session it
made expire on their own, counted from the end of their last request).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection

_REMEMBERED = 100_000  # connections one process keeps (the oldest unused go first)
MAX_CLIENT_BYTES = 64 << 10  # of a client's initialize params kept (more: kept without them)
# An answer a client sends through another replica than the one that asked (see `pass_on`):
# at most this large (an approval's answer is a few hundred bytes), at most this many waiting
# for each asking replica (the oldest go first).
MAX_ANSWER_BYTES = 64 << 10
MAX_ANSWERS_WAITING = 16


@dataclass
class McpConnection:
    owner: str
    client: dict[str, Any] | None = None  # its `initialize` params, as the client sent them
    session_id: str | None = None  # the session of ours it uses, once a call made one


Found = McpConnection | Literal["ended"] | None  # None: unknown (never opened, or expired)


class McpConnections(ABC):
    keep_s: float

    @abstractmethod
    async def opened(self, connection: str, owner: str, client: dict[str, Any] | None) -> None:
        """A connection was opened (or is held here but was forgotten by the store)."""

    @abstractmethod
    async def get(self, connection: str) -> Found:
        """The connection, kept for another `keep_s`."""

    @abstractmethod
    async def request_ended(self, connection: str) -> None:
        """A request on it ended: kept for another `keep_s` from now."""

    @abstractmethod
    async def bind(
        self, connection: str, owner: str, session_id: str, replacing: str | None
    ) -> str | None:
        """Make `session_id` the connection's session if its session is still `replacing`
        (None: it has none): the session it uses now, which is another when a call (here or
        through another replica) bound one first; None if the connection ended meanwhile or is
        another owner's."""

    @abstractmethod
    async def forget(self, connection: str) -> McpConnection | None:
        """The connection ended: what it was (None if unknown); it is `ended` from now on."""

    # Answers to what a replica asks a connection's client (an approval's elicitation): the
    # client may send one through another replica (a load balancer without stickiness), whose
    # MCP transport has nothing waiting for it. While a replica waits (`awaiting`), every answer
    # sent on that connection through another (`pass_on`) is kept for it, and it takes them
    # (`passed_on`) to hand to its own transport. On one machine nothing travels.
    answers_travel = False  # whether answers may come through another replica

    async def awaiting(self, connection: str, replica: str, more: int) -> None:  # noqa: B027
        """`replica` waits for one more answer on `connection` (`more` 1), or one less (-1)."""

    async def pass_on(self, connection: str, replica: str, answer: bytes) -> int:
        """An answer the client sent through `replica`: kept for every other replica waiting
        on that connection; how many."""
        return 0

    async def passed_on(self, connection: str, replica: str) -> list[bytes]:
        """The answers kept for `replica` on that connection, each taken once."""
        return []


def _client_json(client: dict[str, Any] | None) -> str:
    text = json.dumps(client) if client is not None else ""
    return text if len(text) <= MAX_CLIENT_BYTES else ""


class LocalMcpConnections(McpConnections):
    """In this process: its connections live and end here (the transport's own table). What a
    client sent is not kept: nothing else continues its connections."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._known: OrderedDict[str, tuple[McpConnection, float]] = OrderedDict()  # LRU first

    def _expire(self) -> None:
        oldest = time.monotonic() - self.keep_s
        while self._known and next(iter(self._known.values()))[1] < oldest:
            self._known.popitem(last=False)
        while len(self._known) > _REMEMBERED:
            self._known.popitem(last=False)

    def _touch(self, connection: str, found: McpConnection) -> None:
        self._known[connection] = (found, time.monotonic())
        self._known.move_to_end(connection)
        self._expire()

    async def opened(self, connection: str, owner: str, client: dict[str, Any] | None) -> None:
        self._touch(connection, McpConnection(owner))

    async def get(self, connection: str) -> Found:
        self._expire()
        entry = self._known.get(connection)
        if entry is None:
            return None
        self._touch(connection, entry[0])
        return entry[0]

    async def request_ended(self, connection: str) -> None:
        entry = self._known.get(connection)
        if entry is not None:
            self._touch(connection, entry[0])

    async def bind(
        self, connection: str, owner: str, session_id: str, replacing: str | None
    ) -> str | None:
        entry = self._known.get(connection)
        found = entry[0] if entry is not None else McpConnection(owner)  # stdio's: never opened
        if found.owner != owner:
            return None
        if found.session_id == replacing:
            found.session_id = session_id
        self._touch(connection, found)
        return found.session_id

    async def forget(self, connection: str) -> McpConnection | None:
        entry = self._known.pop(connection, None)
        return entry[0] if entry is not None else None


# KEYS: the connection's hash, its ended mark. ARGV: owner, session, replacing ('' for none),
# time to live. A connection never opened through HTTP (stdio's) is made here; another owner's
# is left alone.
_BIND = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HSET', KEYS[1], 'owner', ARGV[1]) end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return false end
local now = redis.call('HGET', KEYS[1], 'session') or ''
if now == ARGV[3] then
  redis.call('HSET', KEYS[1], 'session', ARGV[2])
  now = ARGV[2]
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return now
"""

# KEYS: the connection's hash, its ended mark. ARGV: the mark's time to live.
_FORGET = """
local found = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return found
"""

# KEYS: the connection's hash of waiting replicas, the answers kept for this replica. ARGV: the
# replica, +1 or -1, time to live. A replica waiting no more keeps no answer.
_AWAIT = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
if n <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return n
"""


class SharedMcpConnections(McpConnections):
    """In the shared Redis, under `<prefix>:mcp:<connection>` (a hash: owner, client, session)
    and `<prefix>:mcp-ended:<connection>`, each with a time to live."""

    def __init__(self, connection: RedisConnection, keep_s: float) -> None:
        self.keep_s = keep_s
        self._connection = connection
        self._redis = connection.client
        self._bind = self._redis.register_script(_BIND)
        self._forget = self._redis.register_script(_FORGET)
        self._await = self._redis.register_script(_AWAIT)

    def _keys(self, connection: str) -> list[str]:
        return [
            self._connection.key("mcp", connection),
            self._connection.key("mcp-ended", connection),
        ]

    @property
    def _ttl(self) -> int:
        return max(1, round(self.keep_s))

    async def opened(self, connection: str, owner: str, client: dict[str, Any] | None) -> None:
        key, _ = self._keys(connection)
        with self._connection.errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={"owner": owner, "client": _client_json(client)})
                pipe.expire(key, self._ttl)
                await pipe.execute()

    async def get(self, connection: str) -> Found:
        key, ended = self._keys(connection)
        with self._connection.errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(key)
                pipe.exists(ended)
                pipe.expire(key, self._ttl)
                fields, is_ended, _ = await pipe.execute()
        if is_ended:
            return "ended"
        return _record(fields)

    async def request_ended(self, connection: str) -> None:
        key, _ = self._keys(connection)
        with self._connection.errors():
            await self._redis.expire(key, self._ttl)

    async def bind(
        self, connection: str, owner: str, session_id: str, replacing: str | None
    ) -> str | None:
        with self._connection.errors():
            now = await self._bind(
                keys=self._keys(connection), args=[owner, session_id, replacing or "", self._ttl]
            )
        if now is None:
            return None
        bound = now.decode() if isinstance(now, bytes) else str(now)
        return bound or None

    async def forget(self, connection: str) -> McpConnection | None:
        with self._connection.errors():
            found = await self._forget(keys=self._keys(connection), args=[self._ttl * 2])
        pairs = iter(found or [])
        return _record(dict(zip(pairs, pairs, strict=True)))

    # --- answers: `<prefix>:mcp-awaiting:<connection>` (a hash: replica -> its waits) and
    # `<prefix>:mcp-answers:<connection>:<replica>` (a list), each with a time to live.
    answers_travel = True

    def _awaiting_key(self, connection: str) -> str:
        return self._connection.key("mcp-awaiting", connection)

    def _answers_key(self, connection: str, replica: str) -> str:
        return self._connection.key("mcp-answers", connection, replica)

    async def awaiting(self, connection: str, replica: str, more: int) -> None:
        with self._connection.errors():
            keys = [self._awaiting_key(connection), self._answers_key(connection, replica)]
            await self._await(keys=keys, args=[replica, more, self._ttl])

    async def pass_on(self, connection: str, replica: str, answer: bytes) -> int:
        if len(answer) > MAX_ANSWER_BYTES:
            return 0
        with self._connection.errors():
            waiting = await self._redis.hkeys(self._awaiting_key(connection))
            others = [_text(r) for r in waiting if _text(r) != replica]
            if not others:
                return 0
            async with self._redis.pipeline(transaction=False) as pipe:
                for other in others:
                    key = self._answers_key(connection, other)
                    pipe.rpush(key, answer)
                    pipe.ltrim(key, -MAX_ANSWERS_WAITING, -1)
                    pipe.expire(key, self._ttl)
                await pipe.execute()
        return len(others)

    async def passed_on(self, connection: str, replica: str) -> list[bytes]:
        with self._connection.errors():
            taken = await self._redis.lpop(
                self._answers_key(connection, replica), MAX_ANSWERS_WAITING
            )
        if not isinstance(taken, list):
            return []
        return [a if isinstance(a, bytes) else a.encode() for a in taken]


def _record(fields: dict[Any, Any]) -> McpConnection | None:
    values = {_text(k): _text(v) for k, v in fields.items()}
    if "owner" not in values:
        return None
    client = values.get("client") or ""
    return McpConnection(
        owner=values["owner"],
        client=json.loads(client) if client else None,
        session_id=values.get("session") or None,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
