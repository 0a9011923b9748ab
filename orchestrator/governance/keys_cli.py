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
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from orchestrator.governance import audit_kinds
from orchestrator.governance.cli_option_groups import with_options
from orchestrator.governance.cli_stores import (
    StateDirOption,
    StoreOption,
    Stores,
    fail,
    open_stores,
)
from orchestrator.governance.policy import Policy
from orchestrator.governance.principals import (
    LOCAL_OWNER,
    digest_of,
    new_key,
    new_principal_id,
)
from orchestrator.governance.stores.audit_store import AuditEvent
from orchestrator.governance.stores.principal_store import (
    KeyDigest,
    PrincipalNameTaken,
    PrincipalRecord,
)

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


def _audit(stores: Stores, kind: str, record: PrincipalRecord, **details: Any) -> None:
    """A key.* event, straight into the audit log (the service is not asked). The change is
    made already: a log that cannot be written is said, not a failure of the command."""
    if not stores.audit_enabled:
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
        stores.run(stores.audit.append_events([event]))
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
            raise fail(f"{path} is larger than {MAX_POLICY_FILE_BYTES} bytes: not a policy")
        text = path.read_text()
    except OSError as exc:
        raise fail(f"cannot read the policy file {path}: {exc.strerror or exc}") from None
    try:
        found: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise fail(f"the policy file {path} is not valid {kind}: {exc}") from None
    if not isinstance(found, dict):
        raise fail(
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
        raise fail(f"bad policy ({where}): " + "; ".join(lines)) from None


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
            raise fail(f"--max-limit {pair!r}: write NAME=VALUE, e.g. memory_mb=1024")
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
VolumesOption = Annotated[
    str | None,
    typer.Option(
        metavar="RULE",
        help="Its volumes: read_write (the default), read_only (mounted read-only only, none "
        "made or changed), none.",
        show_default=False,
    ),
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


def policy_flags(
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
    volumes: VolumesOption = None,
) -> dict[str, Any]:
    """The rules the flags of `add` and `set-policy` set, by rule (None: not given)."""
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
        "volumes": volumes,
    }


def _check_name(name: str) -> None:
    reserved = name in (LOCAL_OWNER, audit_kinds.SERVICE_OWNER)  # the log's own names
    if not NAME.match(name) or SETTINGS_NAME.match(name) or reserved:
        raise fail(
            f"{name[:80]!r} cannot name a key: use 1 to 64 letters, digits, '_', '.', '@' or "
            "'-', starting with a letter or digit (not 'local' nor 'service', which name the "
            "service's own events, nor key-<8 hex>, which name the settings' keys)"
        )


def _find(stores: Stores, name: str) -> PrincipalRecord:
    record = stores.run(stores.principals.get_principal(name))
    if record is None:
        raise fail(f"no key named {name!r} (see `code-interpreter keys list`)")
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


E2BShapedOption = Annotated[
    bool,
    typer.Option(
        "--e2b-shaped",
        help="Shape the key as E2B's (e2b_ and 40 hex digits), for E2B clients that check "
        "a key's shape before sending it.",
    ),
]


# --- the commands
@keys_app.command("add")
@with_options("flags", policy_flags)
def add(
    name: Annotated[str, typer.Argument(help="Its name, unique: shown in refusals and the log.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin: sees and answers every key's.")
    ] = False,
    policy_file: PolicyFileOption = None,
    e2b_shaped: E2BShapedOption = False,
    *,
    flags: dict[str, Any],
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Make a key with a name and a policy; print it (once)."""
    _check_name(name)
    policy = _policy({}, policy_file, flags)
    key = new_key(e2b_shaped=e2b_shaped)
    record = PrincipalRecord(
        id=new_principal_id(),
        name=name,
        admin=admin,
        policy=policy,
        keys=[KeyDigest(digest=digest_of(key))],
    )
    with open_stores(state_dir, store, may_create=True) as stores:
        try:
            stores.run(stores.principals.put_principal(record))
        except PrincipalNameTaken:
            raise fail(f"a key named {name!r} exists; rotate it, or pick another name") from None
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
        records = stores.run(stores.principals.principals())
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
    e2b_shaped: E2BShapedOption = False,
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """A new key for the same name and sessions; print it. The old one stops working (after
    --grace-s)."""
    with open_stores(state_dir, store) as stores:
        record = _find(stores, name)
        if record.revoked_at is not None:
            raise fail(f"key {name!r} is revoked: add a new one instead")
        now = time.time()
        key = new_key(e2b_shaped=e2b_shaped)
        old = [
            k.model_copy(update={"expires_at": min(k.expires_at or now + grace_s, now + grace_s)})
            for k in record.keys
            if grace_s > 0 and (k.expires_at is None or k.expires_at > now)
        ]
        held = [*old[-(MAX_KEYS - 1) :], KeyDigest(digest=digest_of(key))]
        updated = record.model_copy(update={"keys": held, "updated_at": now})
        stores.run(stores.principals.put_principal(updated))
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
        stores.run(stores.principals.put_principal(updated))
        _audit(stores, audit_kinds.KEY_REVOKED, updated)
    typer.echo(f"key {name!r} revoked: its sessions end within the service's reap interval")


@keys_app.command("set-policy")
@with_options("flags", policy_flags)
def set_policy(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    policy_file: PolicyFileOption = None,
    admin: Annotated[
        bool | None,
        typer.Option("--admin/--no-admin", help="Make it an admin, or not.", show_default=False),
    ] = None,
    *,
    flags: dict[str, Any],
    state_dir: StateDirOption = None,
    store: StoreOption = None,
) -> None:
    """Replace a key's policy with a file's (--policy), or change the rules the flags name;
    sessions already running keep what they were given, every new request is held to it."""
    if policy_file is None and admin is None and all(v is None for v in flags.values()):
        raise fail("say what to change: --policy FILE, or flags (see --help)")
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
        stores.run(stores.principals.put_principal(updated))
        _audit(
            stores,
            audit_kinds.KEY_POLICY,
            updated,
            admin=updated.admin,
            policy=policy.describe_rules(),
        )
    typer.echo(f"key {name!r}: policy set")
    typer.echo(json.dumps(policy.describe_rules() or "full access"))
