"""Where the `keys` and `audit` commands find the service's store: where its settings
(environment, config file) say, unless `--state-dir` or `--store` say otherwise. Both commands
open it the same way, so one never reads a store the other did not write."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from orchestrator.state_store.audit_store import AuditStore
from orchestrator.state_store.principal_store import PrincipalStore

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
    """The principal and audit stores of one state dir or Redis."""

    def __init__(self, principals: PrincipalStore, audit: AuditStore, audit_enabled: bool) -> None:
        """`audit_enabled`: whether the service keeps an audit log (a change the CLI makes is
        then recorded in it)."""
        self.principals = principals
        self.audit = audit
        self.audit_enabled = audit_enabled


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
    from orchestrator.state_store.redis_store import StoreUnavailable

    try:  # only where things are is read; keys are not needed for that
        settings = Settings(auth_disabled=True)
    except ValidationError as exc:
        raise fail(f"the service's settings are bad: {exc.errors()[0]['msg']}") from None
    url = store_url or (
        settings.store_url.get_secret_value() if settings.store_url is not None else None
    )
    directory = state_dir or settings.state_dir
    if url is not None:
        from orchestrator.state_store.redis_store import RedisStore

        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise fail("--store must be redis://HOST:PORT/DB (or rediss://, unix://)")
        try:
            check_store_url(url, allow_unauthenticated=settings.store_allow_unauthenticated)
        except UnauthenticatedStore as exc:
            raise fail(str(exc)) from None
        redis_store = RedisStore(
            url,
            snapshots_dir=directory / "snapshots",
            prefix=settings.store_prefix,
            timeout_s=settings.store_timeout_s,
            allow_unauthenticated=settings.store_allow_unauthenticated,
        )
        try:
            redis_store.ping()
            yield Stores(redis_store.principals, redis_store.audit, settings.audit_enabled)
        except StoreUnavailable as exc:
            raise fail(f"{exc} (is --store the cluster's store?)") from None
        except UnauthenticatedStore as exc:
            raise fail(str(exc)) from None
        finally:
            redis_store.close()
        return
    from orchestrator.state_store.sqlite_store import SqliteStore

    database = directory / "state.db"
    made = not database.is_file()
    if made and not may_create:
        raise fail(
            f"no service state in {directory} (no state.db): give the service's --state-dir "
            "(its CODE_INTERPRETER_STATE_DIR), or --store for cluster mode"
        )
    sqlite_store = SqliteStore(directory)
    if made:
        typer.echo(
            f"made {database}: a new state dir; the service must be started with it "
            "(CODE_INTERPRETER_STATE_DIR) to take this key",
            err=True,
        )
    try:
        yield Stores(sqlite_store.principals, sqlite_store.audit, settings.audit_enabled)
    finally:
        sqlite_store.close()
