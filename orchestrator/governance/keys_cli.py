"""`code-interpreter keys ...`: add, list, show, rotate and revoke keys, and set their policies.

It writes the store the service reads (SQLite under the state dir, or the cluster's Redis), from
another process while the service runs; the service sees each change within about a second, so
no restart is needed. A key is printed once, when made, and kept only as its SHA-256.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from orchestrator.governance import audit_kinds
from orchestrator.governance.policy import Policy
from orchestrator.governance.principals import (
    LOCAL_OWNER,
    digest_of,
    new_key,
    new_principal_id,
)
from orchestrator.state_store.audit_store import AuditEvent, AuditStore
from orchestrator.state_store.principal_store import (
    KeyDigest,
    PrincipalNameTaken,
    PrincipalRecord,
    PrincipalStore,
)

EXIT_USAGE = 2
MAX_POLICY_FILE_BYTES = 1 << 20
MAX_GRACE_S = 30 * 86400.0
MAX_KEYS = 8  # keys one name holds at once (rotations within a grace period); oldest go first
# Names people read in refusals and the audit log; never one a settings key has (key-<hex>).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
SETTINGS_NAME = re.compile(r"^key-[0-9a-f]{8}$")

keys_app = typer.Typer(
    help="Keys with names and policies: add, list, show, rotate, revoke, set-policy. Changes "
    "take effect in the running service within a second, without a restart.",
    no_args_is_help=True,
)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(EXIT_USAGE)


# --- where the keys are: the service's own store
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        metavar="DIR",
        help="The service's state dir (its state.db holds the keys).  [default: the service's "
        "setting, CODE_INTERPRETER_STATE_DIR]",
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


class _Stores:
    """The principal store, and the audit store beside it, of one state dir or Redis."""

    def __init__(self, principals: PrincipalStore, audit: AuditStore | None) -> None:
        """`audit`: None where the service keeps no audit log (audit_enabled false)."""
        self.principals = principals
        self.audit = audit


@contextmanager
def open_stores(
    state_dir: Path | None, store_url: str | None, *, may_create: bool = False
) -> Iterator[_Stores]:
    """The store the service uses, as its settings (environment, config file) say, unless the
    options say otherwise. A state dir without the service's state.db is refused (a typo would
    otherwise read, or write, a database no service uses), unless `may_create` (a first key,
    added before the service ever ran: said on stderr). A store that fails is one line."""
    from orchestrator.config import Settings
    from orchestrator.state_store.redis_store import StoreUnavailable

    try:  # only where things are is read; keys are not needed for that
        settings = Settings(auth_disabled=True)
    except ValidationError as exc:
        raise _fail(f"the service's settings are bad: {exc.errors()[0]['msg']}") from None
    url = store_url or (
        settings.store_url.get_secret_value() if settings.store_url is not None else None
    )
    directory = state_dir or settings.state_dir
    if url is not None:
        from orchestrator.state_store.redis_store import RedisStore

        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise _fail("--store must be redis://HOST:PORT/DB (or rediss://, unix://)")
        redis_store = RedisStore(
            url,
            snapshots_dir=directory / "snapshots",
            prefix=settings.store_prefix,
            timeout_s=settings.store_timeout_s,
        )
        try:
            redis_store.ping()
            kept = redis_store.audit if settings.audit_enabled else None
            yield _Stores(redis_store.principals, kept)
        except StoreUnavailable as exc:
            raise _fail(f"{exc} (is --store the cluster's store?)") from None
        finally:
            redis_store.close()
        return
    from orchestrator.state_store.sqlite_store import SqliteStore

    database = directory / "state.db"
    made = not database.is_file()
    if made and not may_create:
        raise _fail(
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
        audit = sqlite_store.audit if settings.audit_enabled else None
        yield _Stores(sqlite_store.principals, audit)
    finally:
        sqlite_store.close()


def _audit(stores: _Stores, kind: str, record: PrincipalRecord, **details: Any) -> None:
    """A key.* event, straight into the audit log (the service is not asked). The change is
    made already: a log that cannot be written is said, not a failure of the command."""
    if stores.audit is None:
        return
    event = AuditEvent(
        id=os.urandom(12).hex(),
        time=time.time(),
        kind=kind,
        owner=record.id,
        principal=record.name,
        details={"by": f"cli:{_user()}", **details},
    )
    try:
        stores.audit.append_events([event])
    except Exception as exc:
        typer.secho(f"warning: the audit log did not take the {kind} event: {exc}", err=True)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid())


# --- policies: from a file, then the flags
def read_policy_file(path: Path) -> dict[str, Any]:
    """A policy file's fields: TOML if it ends in .toml, else JSON."""
    try:
        if path.stat().st_size > MAX_POLICY_FILE_BYTES:
            raise _fail(f"{path} is larger than {MAX_POLICY_FILE_BYTES} bytes: not a policy")
        text = path.read_text()
    except OSError as exc:
        raise _fail(f"cannot read the policy file {path}: {exc.strerror or exc}") from None
    try:
        found: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise _fail(f"the policy file {path} is not valid {kind}: {exc}") from None
    if not isinstance(found, dict):
        raise _fail(
            f"the policy file {path} must hold an object of rules, not {type(found).__name__}"
        )
    return found


def make_policy(fields: dict[str, Any], where: str) -> Policy:
    """A Policy, or a usage error naming each bad field."""
    try:
        return Policy.model_validate(fields)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = ".".join(str(p) for p in error["loc"]) or "(the whole policy)"
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = f"no such rule; rules are: {', '.join(Policy.model_fields)}"
            lines.append(f"{field}: {message}")
        raise _fail(f"bad policy ({where}): " + "; ".join(lines)) from None


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [n.strip() for n in text.split(",") if n.strip()]


def _limits(pairs: list[str] | None) -> dict[str, float] | None:
    if not pairs:
        return None
    limits: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            limits[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise _fail(f"--max-limit {pair!r}: write NAME=VALUE, e.g. memory_mb=1024")
    return limits


BackendsOption = Annotated[
    str | None,
    typer.Option(metavar="A,B", help="Backends its sessions may use (e.g. local)."),
]
ImagesOption = Annotated[
    str | None, typer.Option(metavar="A,B", help="Kernel images (docker) it may use.")
]
LanguagesOption = Annotated[
    str | None, typer.Option(metavar="A,B", help="Languages its code may run in.")
]
NetworkOption = Annotated[
    str | None,
    typer.Option(
        metavar="POLICY",
        help="The most network its sessions may have: none, any, "
        "or host:port,... (within the service's ceiling).",
    ),
]
ToolsOption = Annotated[
    str | None, typer.Option("--tools", metavar="A,B", help="Host tools it may use.")
]
ApprovalToolsOption = Annotated[
    str | None,
    typer.Option(metavar="A,B", help="Host tools whose every call waits for a human."),
]
CommandsOption = Annotated[
    bool | None,
    typer.Option(
        "--commands/--no-commands",
        help="Whether it may run shell commands, background processes and terminals.",
        show_default=False,
    ),
]
ApproveExecutionsOption = Annotated[
    bool | None,
    typer.Option(
        "--approve-executions/--no-approve-executions",
        help="Every execution waits for a human.",
        show_default=False,
    ),
]
ApproveCommandsOption = Annotated[
    bool | None,
    typer.Option(
        "--approve-commands/--no-approve-commands",
        help="Every command waits for a human.",
        show_default=False,
    ),
]
SelfApproveOption = Annotated[
    bool | None,
    typer.Option(
        "--self-approve/--no-self-approve",
        help="It may answer its own sessions' approval requests.",
        show_default=False,
    ),
]
MaxSessionsOption = Annotated[
    int | None, typer.Option(metavar="N", min=0, help="Sessions it may hold at once.")
]
MaxLimitOption = Annotated[
    list[str] | None,
    typer.Option(
        "--max-limit",
        metavar="NAME=VALUE",
        help="A ceiling on a resource limit its sessions may ask for (memory_mb=1024); repeatable.",
    ),
]
PolicyFileOption = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        metavar="FILE",
        help="The policy's rules, JSON or TOML (.toml); the flags change what it says.",
    ),
]


def _policy(
    base: dict[str, Any],
    policy_file: Path | None,
    flags: dict[str, Any],
) -> Policy:
    """`base` (the key's policy, or nothing), replaced by the file's if given, then the flags."""
    fields = read_policy_file(policy_file) if policy_file is not None else dict(base)
    fields.update({name: value for name, value in flags.items() if value is not None})
    return make_policy(fields, str(policy_file) if policy_file is not None else "the flags")


def _flags(
    backends: str | None,
    images: str | None,
    languages: str | None,
    network: str | None,
    tools: str | None,
    approval_tools: str | None,
    commands: bool | None,
    approve_executions: bool | None,
    approve_commands: bool | None,
    self_approve: bool | None,
    max_sessions: int | None,
    max_limit: list[str] | None,
) -> dict[str, Any]:
    return {
        "backends": _names(backends),
        "images": _names(images),
        "languages": _names(languages),
        "network": network,
        "host_tools": _names(tools),
        "approval_tools": _names(approval_tools),
        "commands": commands,
        "approve_executions": approve_executions,
        "approve_commands": approve_commands,
        "self_approve": self_approve,
        "max_sessions": max_sessions,
        "max_limits": _limits(max_limit),
    }


def _check_name(name: str) -> None:
    reserved = name in (LOCAL_OWNER, audit_kinds.SERVICE_OWNER)  # the log's own names
    if not NAME.match(name) or SETTINGS_NAME.match(name) or reserved:
        raise _fail(
            f"{name[:80]!r} cannot name a key: use 1 to 64 letters, digits, '_', '.', '@' or "
            "'-', starting with a letter or digit (not 'local' nor 'service', which name the "
            "service's own events, nor key-<8 hex>, which name the settings' keys)"
        )


def _find(stores: _Stores, name: str) -> PrincipalRecord:
    record = stores.principals.get_principal(name)
    if record is None:
        raise _fail(f"no key named {name!r} (see `code-interpreter keys list`)")
    return record


def _describe(record: PrincipalRecord, now: float) -> dict[str, Any]:
    """What `list` and `show` say of a key: never the key, nor its digest."""
    live = [k for k in record.keys if k.expires_at is None or k.expires_at > now]
    return {
        "name": record.name,
        "id": record.id,
        "admin": record.admin,
        "state": "revoked" if record.revoked_at is not None else "active",
        "keys": len(live),
        "created_at": _when(record.created_at),
        "updated_at": _when(record.updated_at),
        "revoked_at": _when(record.revoked_at) if record.revoked_at is not None else None,
        "policy": record.policy.describe_rules(),
    }


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _print_key(key: str, what: str) -> None:
    typer.echo(key)
    typer.secho(
        f"{what}. Keep it now: it is shown only this once (only its SHA-256 is stored). It "
        "works in the running service within a second.",
        err=True,
    )


# --- the commands
@keys_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Its name, unique: shown in refusals and the log.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin: sees and answers every key's.")
    ] = False,
    policy_file: PolicyFileOption = None,
    backends: BackendsOption = None,
    images: ImagesOption = None,
    languages: LanguagesOption = None,
    network: NetworkOption = None,
    tools: ToolsOption = None,
    approval_tools: ApprovalToolsOption = None,
    commands: CommandsOption = None,
    approve_executions: ApproveExecutionsOption = None,
    approve_commands: ApproveCommandsOption = None,
    self_approve: SelfApproveOption = None,
    max_sessions: MaxSessionsOption = None,
    max_limit: MaxLimitOption = None,
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Make a key with a name and a policy; print it (once)."""
    _check_name(name)
    flags = _flags(
        backends, images, languages, network, tools, approval_tools, commands,
        approve_executions, approve_commands, self_approve, max_sessions, max_limit,
    )  # fmt: skip
    policy = _policy({}, policy_file, flags)
    key = new_key()
    record = PrincipalRecord(
        id=new_principal_id(),
        name=name,
        admin=admin,
        policy=policy,
        keys=[KeyDigest(digest=digest_of(key))],
    )
    with open_stores(state_dir, store, may_create=True) as stores:
        try:
            stores.principals.put_principal(record)
        except PrincipalNameTaken:
            raise _fail(f"a key named {name!r} exists; rotate it, or pick another name") from None
        _audit(stores, audit_kinds.KEY_ADDED, record, admin=admin, policy=policy.describe_rules())
    _print_key(key, f"key {name!r} added")


@keys_app.command("list")
def list_keys(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one per key.")] = False,
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """The keys made here: names, states and policies (never a key or its digest)."""
    with open_stores(state_dir, store) as stores:
        records = stores.principals.principals()
    now = time.time()
    if as_json:
        for record in records:
            typer.echo(json.dumps(_describe(record, now)))
        return
    if not records:
        typer.echo("no keys yet: code-interpreter keys add NAME")
        return
    typer.echo(f"{'NAME':24} {'STATE':8} {'ADMIN':5} {'KEYS':4}  POLICY")
    for record in records:
        d = _describe(record, now)
        rules = json.dumps(d["policy"], separators=(",", ":")) if d["policy"] else "full access"
        typer.echo(
            f"{record.name:24} {d['state']:8} {'yes' if record.admin else 'no':5} "
            f"{d['keys']:<4}  {rules}"
        )


@keys_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """One key's name, id, state and whole policy, as JSON (never the key or its digest)."""
    with open_stores(state_dir, store) as stores:
        record = _find(stores, name)
    described = _describe(record, time.time())
    described["policy"] = record.policy.model_dump(mode="json")
    typer.echo(json.dumps(described, indent=2))


@keys_app.command("rotate")
def rotate(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    grace_s: Annotated[
        float,
        typer.Option(
            "--grace-s",
            metavar="S",
            min=0,
            max=MAX_GRACE_S,
            help="How long the old key keeps working, so clients can move to the new one.",
        ),
    ] = 0.0,
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """A new key for the same name and sessions; print it. The old one stops working (after
    --grace-s)."""
    with open_stores(state_dir, store) as stores:
        record = _find(stores, name)
        if record.revoked_at is not None:
            raise _fail(f"key {name!r} is revoked: add a new one instead")
        now = time.time()
        key = new_key()
        old = [
            k.model_copy(update={"expires_at": min(k.expires_at or now + grace_s, now + grace_s)})
            for k in record.keys
            if grace_s > 0 and (k.expires_at is None or k.expires_at > now)
        ]
        held = [*old[-(MAX_KEYS - 1) :], KeyDigest(digest=digest_of(key))]
        updated = record.model_copy(update={"keys": held, "updated_at": now})
        stores.principals.put_principal(updated)
        _audit(stores, audit_kinds.KEY_ROTATED, updated, grace_s=grace_s)
    _print_key(
        key,
        f"key {name!r} rotated"
        + (
            f"; the old one works {grace_s:g} s more"
            if grace_s
            else "; the old one no longer works"
        ),
    )


@keys_app.command("revoke")
def revoke(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Stop a key for good: its calls answer 401 and its sessions end (running and paused),
    within a second and a reap interval."""
    with open_stores(state_dir, store) as stores:
        record = _find(stores, name)
        if record.revoked_at is not None:
            typer.echo(f"key {name!r} was revoked already")
            return
        now = time.time()
        updated = record.model_copy(update={"revoked_at": now, "updated_at": now, "keys": []})
        stores.principals.put_principal(updated)
        _audit(stores, audit_kinds.KEY_REVOKED, updated)
    typer.echo(f"key {name!r} revoked: its sessions end within the service's reap interval")


@keys_app.command("set-policy")
def set_policy(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    policy_file: PolicyFileOption = None,
    admin: Annotated[
        bool | None,
        typer.Option("--admin/--no-admin", help="Make it an admin, or not.", show_default=False),
    ] = None,
    backends: BackendsOption = None,
    images: ImagesOption = None,
    languages: LanguagesOption = None,
    network: NetworkOption = None,
    tools: ToolsOption = None,
    approval_tools: ApprovalToolsOption = None,
    commands: CommandsOption = None,
    approve_executions: ApproveExecutionsOption = None,
    approve_commands: ApproveCommandsOption = None,
    self_approve: SelfApproveOption = None,
    max_sessions: MaxSessionsOption = None,
    max_limit: MaxLimitOption = None,
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Replace a key's policy with a file's (--policy), or change the rules the flags name;
    sessions already running keep what they were given, every new request is held to it."""
    flags = _flags(
        backends, images, languages, network, tools, approval_tools, commands,
        approve_executions, approve_commands, self_approve, max_sessions, max_limit,
    )  # fmt: skip
    if policy_file is None and admin is None and all(v is None for v in flags.values()):
        raise _fail("say what to change: --policy FILE, or flags (see --help)")
    with open_stores(state_dir, store) as stores:
        record = _find(stores, name)
        base = record.policy.model_dump(mode="json", exclude_defaults=True)
        policy = _policy(base, policy_file, flags)
        updated = record.model_copy(
            update={
                "policy": policy,
                "admin": record.admin if admin is None else admin,
                "updated_at": time.time(),
            }
        )
        stores.principals.put_principal(updated)
        _audit(
            stores,
            audit_kinds.KEY_POLICY,
            updated,
            admin=updated.admin,
            policy=policy.describe_rules(),
        )
    typer.echo(f"key {name!r}: policy set")
    typer.echo(json.dumps(policy.describe_rules() or "full access"))
