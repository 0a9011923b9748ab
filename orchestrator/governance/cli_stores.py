"""Where the `keys` and `audit` commands find the service's store: where its settings
(environment, config file) say, unless `--state-dir` or `--store` say otherwise. Both commands
open it the same way, so one never reads a store the other did not write. The stores are async:
a command runs their calls on an event loop of its own (`Stores.run`), one for the command's
whole use of them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from orchestrator.governance.stores import GovernanceStores

T = TypeVar("T")
EXIT_USAGE = 2

StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        metavar="DIR",
        help="The service's state dir (its state.db holds the keys and the audit log).  "
        "[default: the service's setting, CODE_INTERPRETER_STATE_DIR]",
    ),
]
StoreOption = Annotated[
    str | None,
    typer.Option(
        "--store",
        metavar="URL",
        help="The cluster's shared store (redis://HOST:PORT/DB) instead of a state dir.  "
        "[default: the service's setting, CODE_INTERPRETER_STORE_URL]",
    ),
]


def fail(message: str) -> typer.Exit:
    """A usage error: one red line on stderr, exit 2 (raise what this returns)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(EXIT_USAGE)


class Stores:
    """The principal and audit stores of one state dir or Redis, and the loop their calls
    run on."""

    def __init__(
        self, stores: GovernanceStores, audit_enabled: bool, runner: asyncio.Runner
    ) -> None:
        """`audit_enabled`: whether the service keeps an audit log (a change the CLI makes is
        then recorded in it)."""
        self.principals = stores.principals
        self.audit = stores.audit
        self.audit_enabled = audit_enabled
        self._runner = runner

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        """Await one store call (the command's loop: the Redis client's connections live there)."""
        return self._runner.run(call)


@contextmanager
def open_stores(
    state_dir: Path | None, store_url: str | None, *, may_create: bool = False
) -> Iterator[Stores]:
    """The store the service uses, as its settings say, unless the options say otherwise. A
    state dir without the service's state.db is refused (a typo would otherwise read, or
    write, a database no service uses), unless `may_create` (a first key, added before the
    service ever ran: said on stderr). A store that fails is one line, not a traceback."""
    from orchestrator.config import Settings
    from orchestrator.state_store.redis_auth import UnauthenticatedStore, check_store_url

    try:  # only where things are is read; keys are not needed for that
        settings = Settings(auth_disabled=True)
    except ValidationError as exc:
        raise fail(f"the service's settings are bad: {exc.errors()[0]['msg']}") from None
    url = store_url or (
        settings.store_url.get_secret_value() if settings.store_url is not None else None
    )
    directory = state_dir or settings.state_dir
    if url is not None:
        from orchestrator.governance.stores import redis_stores
        from orchestrator.state_store.redis_connection import RedisConnection, StoreUnavailable

        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise fail("--store must be redis://HOST:PORT/DB (or rediss://, unix://)")
        try:
            check_store_url(url, allow_unauthenticated=settings.store_allow_unauthenticated)
        except UnauthenticatedStore as exc:
            raise fail(str(exc)) from None
        connection = RedisConnection(
            url,
            prefix=settings.store_prefix,
            timeout_s=settings.store_timeout_s,
            allow_unauthenticated=settings.store_allow_unauthenticated,
        )
        with asyncio.Runner() as runner:
            try:
                runner.run(connection.ping())
                yield Stores(redis_stores(connection), settings.audit_enabled, runner)
            except StoreUnavailable as exc:
                raise fail(f"{exc} (is --store the cluster's store?)") from None
            except UnauthenticatedStore as exc:
                raise fail(str(exc)) from None
            finally:
                runner.run(connection.close())
        return
    from orchestrator.governance.stores import sqlite_stores
    from orchestrator.state_store.sqlite_db import SqliteDatabase

    database = directory / "state.db"
    made = not database.is_file()
    if made and not may_create:
        raise fail(
            f"no service state in {directory} (no state.db): give the service's --state-dir "
            "(its CODE_INTERPRETER_STATE_DIR), or --store for cluster mode"
        )
    db = SqliteDatabase(directory)
    stores = sqlite_stores(db)
    if made:
        typer.echo(
            f"made {database}: a new state dir; the service must be started with it "
            "(CODE_INTERPRETER_STATE_DIR) to take this key",
            err=True,
        )
    try:
        with asyncio.Runner() as runner:
            yield Stores(stores, settings.audit_enabled, runner)
    finally:
        stores.close()
        db.close()
