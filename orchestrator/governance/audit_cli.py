"""`code-interpreter audit ...`: read, export and prune the audit log where the service keeps it
(its state dir's SQLite file, or the shared Redis of cluster mode), while it runs or not.

Whoever can read the state dir (or reach the Redis) can read every key's events: the CLI is an
operator's tool, answering as an admin key would.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer

from orchestrator.governance.cli_option_groups import with_options
from orchestrator.governance.cli_stores import (
    StateDirOption,
    StoreOption,
    Stores,
    fail,
    open_stores,
)
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery

EXPORT_PAGE = 500
SUMMARY_CHARS = 80  # of a listed event's details

audit_app = typer.Typer(
    help="Read, export and prune the audit log (docs/governance.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

KeyOption = Annotated[
    str | None, typer.Option("--key", metavar="NAME", help="Only this key's events.")
]
SessionOption = Annotated[
    str | None, typer.Option("--session", metavar="ID", help="Only this session's events.")
]
KindOption = Annotated[
    list[str] | None,
    typer.Option("--kind", metavar="KIND", help="Only events of this kind (repeatable, or a,b)."),
]
SinceOption = Annotated[
    str | None,
    typer.Option(metavar="TIME", help="From this time: ISO 8601, epoch seconds, or an age (2h)."),
]
UntilOption = Annotated[
    str | None,
    typer.Option(metavar="TIME", help="Before this time: ISO 8601, epoch seconds, or an age."),
]
BeforeOption = Annotated[
    int | None,
    typer.Option(metavar="SEQ", help="Events older than this one (the cursor a listing gives)."),
]


_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_age(text: str) -> float | None:
    """Seconds in an age such as 90s, 15m, 2h, 30d; None if it is not one."""
    found = _AGE.match(text.strip())
    return float(found.group(1)) * _SECONDS[found.group(2)] if found else None


def _moment(text: str | None, option: str) -> float | None:
    """A time an option gives: an age before now, else what the API takes."""
    if text is None:
        return None
    age = parse_age(text)
    if age is not None:
        return datetime.now(UTC).timestamp() - age
    from orchestrator.governance.audit import BadAuditQuery, parse_time

    try:
        return parse_time(text)
    except BadAuditQuery as exc:
        raise fail(f"{option}: {exc}, or an age (2h, 30m, 7d)") from None


def audit_filters(
    key: KeyOption = None,
    session: SessionOption = None,
    kind: KindOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    before: BeforeOption = None,
) -> AuditQuery:
    """The query the filters of `list` and `export` make (its limit: the command's)."""
    from orchestrator.governance.audit import BadAuditQuery, parse_kinds

    try:
        kinds = parse_kinds(kind)
    except BadAuditQuery as exc:
        raise fail(f"--kind: {exc}") from None
    return AuditQuery(
        principal=key,
        session_id=session,
        kinds=kinds,
        since=_moment(since, "--since"),
        until=_moment(until, "--until"),
        before_seq=before,
    )


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


# Control characters (C0, DEL, C1): text typed into a terminal, replayed raw, would drive the
# terminal of the admin who lists it (escape sequences move the cursor, rewrite the screen).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _shown(text: str) -> str:
    """`text` with every control character as `\\xNN`, so it prints as it is."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _summary(details: dict[str, Any]) -> str:
    text = " ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in details.items()
        if v is not None
    )
    text = _shown(" ".join(text.split()))  # one line, whatever the code held, and inert
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def _line(event: AuditEvent) -> str:
    joined = "  ".join(
        [
            f"{event.seq or 0:>8}",
            _when(event.time),
            f"{event.principal:<16}",
            f"{event.kind:<18}",
            f"{event.session_id or '-':<27}",
            f"{event.status or '-':<9}",
            _summary(event.details),
        ]
    )
    return _shown(joined)  # names and statuses too


@audit_app.command("list")
@with_options("filters", audit_filters)
def list_events(
    state_dir: StateDirOption = None,
    store: StoreOption = None,
    *,
    filters: AuditQuery,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Events to list.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, as export writes.")] = False,
) -> None:
    """List audit events, newest first: seq, time (UTC), key, kind, session, status, details.
    When there are more, the last line says the --before that lists them."""
    query = filters.model_copy(update={"limit": limit})
    with open_stores(state_dir, store) as stores:
        page = stores.run(stores.audit.query_page(query))
    for event in page.events:
        typer.echo(event.model_dump_json() if as_json else _line(event))
    if page.next_before is not None and not as_json:
        typer.echo(f"more: --before {page.next_before}")


@audit_app.command("export")
@with_options("filters", audit_filters)
def export_events(
    state_dir: StateDirOption = None,
    store: StoreOption = None,
    *,
    filters: AuditQuery,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="Write here, not to stdout."),
    ] = None,
) -> None:
    """Every event the filters select, as JSON lines (newest first), read a page at a time."""
    query = filters.model_copy(update={"limit": EXPORT_PAGE})
    with open_stores(state_dir, store) as stores:
        if output is None:
            count = _export(stores, query, sys.stdout)
        else:
            with output.open("w", encoding="utf-8") as out:
                count = _export(stores, query, out)
    typer.echo(f"{count} events exported", err=True)


def _export(stores: Stores, query: AuditQuery, out: TextIO) -> int:
    count = 0
    while True:
        page = stores.run(stores.audit.query_page(query))
        for event in page.events:
            out.write(event.model_dump_json() + "\n")
            count += 1
        if page.next_before is None:
            return count
        query = query.model_copy(update={"before_seq": page.next_before})


@audit_app.command("prune")
def prune_events(
    older_than: Annotated[
        str,
        typer.Option(metavar="AGE", help="Delete events older than this: 90d, 12h, 30m, 45s."),
    ],
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Delete old events now (the service also does, past its audit_retention_s)."""
    age = parse_age(older_than)
    if age is None:
        raise fail(f"--older-than: {older_than!r} is not an age such as 90d, 12h, 30m or 45s")
    cutoff = datetime.now(UTC).timestamp() - age
    with open_stores(state_dir, store) as stores:
        gone = stores.run(stores.audit.delete_events_before(cutoff))
    typer.echo(f"{gone} events older than {_when(cutoff)} deleted")
