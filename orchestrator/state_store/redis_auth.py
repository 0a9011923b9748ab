"""Whether the shared store (Redis) is reached with a password, and demands one.

The store holds every key's principal record (its policy, whether it is an admin) and the audit
log: whatever can write to it can make any key an admin and erase what was recorded. So the
service uses a Redis only with a password in its URL, and only a Redis that refuses a
connection without one, unless the operator says, with `store_allow_unauthenticated`, that
nothing but the service's replicas can reach it (docs/cluster.md, "Securing the cluster").

The URL forms are redis-py's: `redis://:PASSWORD@HOST:PORT/DB` (the `requirepass` password),
`redis://USER:PASSWORD@HOST:PORT/DB` (an ACL user), the same with `rediss://` (TLS), and
`?password=...` in the query (a `unix://` socket's form). The URL checks import no Redis: the
settings run them before anything connects.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

ALLOW_SETTING = "CODE_INTERPRETER_STORE_ALLOW_UNAUTHENTICATED"
HOW_TO_FIX = (
    "Give the Redis a password (`requirepass PASSWORD` in its configuration, or an ACL user with "
    "one) and put it in the store URL: redis://:PASSWORD@HOST:PORT/DB, or "
    "redis://USER:PASSWORD@HOST:PORT/DB for an ACL user (rediss:// for TLS; "
    "unix:///path/redis.sock?db=1&password=PASSWORD for a socket). Only for a Redis that "
    f"nothing but this service's replicas and Ray can reach, set {ALLOW_SETTING}=true instead "
    "(docs/cluster.md, 'Securing the cluster')."
)
RISK = "whatever reaches it could make any key an admin and erase the audit log"


class UnauthenticatedStore(ValueError):
    """The store would be used without authentication, and the operator did not allow it."""


def has_password(url: str) -> bool:
    """Whether redis-py would authenticate with this URL (a password in it, either form)."""
    parts = urlsplit(url)
    if parts.password:
        return True
    return any(value for value in parse_qs(parts.query).get("password", []))


def shown_url(url: str) -> str:
    """The URL as an error may say it: no user, no password, no query (it may hold one)."""
    parts = urlsplit(url)
    where = parts.netloc.rsplit("@", 1)[-1]
    hidden = "***@" if "@" in parts.netloc else ""
    return f"{parts.scheme}://{hidden}{where}{parts.path}"


def check_store_url(url: str, *, allow_unauthenticated: bool) -> None:
    """Refuse (`UnauthenticatedStore`) a store URL without a password, unless allowed."""
    if allow_unauthenticated or has_password(url):
        return
    raise UnauthenticatedStore(
        f"the store URL ({shown_url(url)}) has no password: the service will not keep its "
        f"keys and audit log in a Redis anyone may write to ({RISK}). {HOW_TO_FIX}"
    )


def open_server_refused(url: str) -> UnauthenticatedStore:
    """The refusal of a Redis that answered a connection which sent no password."""
    return UnauthenticatedStore(
        f"the Redis of the store ({shown_url(url)}) answers a connection that sends no "
        f"password (its default user has none): {RISK}. Set `requirepass`, or turn its default "
        f"user off (`ACL SETUSER default off`) and keep the ACL user of the URL. {HOW_TO_FIX}"
    )


async def answers_without_password(url: str, timeout_s: float) -> bool:
    """Whether the Redis of `url` answers PING on a connection that sends no user or password
    (its default user has none). Its failures are redis-py's errors, for the caller to tell."""
    import redis  # only here: the settings import this module without cluster mode's packages
    import redis.asyncio
    from redis.exceptions import NoPermissionError

    pool = redis.asyncio.ConnectionPool.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    for credential in ("username", "password"):  # what the URL gave: not sent on this one
        pool.connection_kwargs.pop(credential, None)
    anonymous = redis.asyncio.Redis(connection_pool=pool)
    try:
        await anonymous.ping()
    except redis.AuthenticationError:
        return False
    except redis.ResponseError as exc:
        # NOPERM: a default user that is on without a password but may run nothing (an ACL
        # set-up that locks it down, `ACL SETUSER default on nopass -@all`) answers no command.
        if str(exc).startswith(("NOAUTH", "NOPERM")) or isinstance(exc, NoPermissionError):
            return False
        raise
    finally:
        await anonymous.aclose()
        await pool.disconnect()
    return True
