"""`code-interpreter keys ...` against a live service's state dir: keys are kept hashed, never
printed again, and each change (add, rotate, set-policy) takes effect without a restart; a
bad policy file is a clear error naming the field."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from orchestrator.governance.keys_cli import MAX_KEYS
from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from tests.orchestrator.governance.conftest import CliResult, eventually, unique_name
from tests.orchestrator.governance.store_handles import local_store
from tests.orchestrator.service.conftest import Server


def status_of(server: Server, key: str) -> int:
    with server.client(key) as api:
        return api.get("/v1/whoami").status_code


def test_a_key_is_kept_hashed_and_never_shown_again(
    governed_server: Server,
    keys: Callable[..., CliResult],
    add_key: Callable[..., str],
) -> None:
    name = unique_name("hashed")
    key = add_key(name, "--backends", "local")
    with governed_server.client(key) as api:
        me = api.get("/v1/whoami").json()
    assert me["name"] == name and me["policy"]["backends"] == ["local"]
    digest = hashlib.sha256(key.encode()).hexdigest()
    stored = b"".join(p.read_bytes() for p in governed_server.state_dir.glob("state.db*"))
    assert digest.encode() in stored  # kept: its digest (in the database or its WAL)...
    assert key.encode() not in stored  # ... never the key
    assert key[4:].encode() not in stored
    listed = keys("list")
    shown = keys("show", name)
    as_json = keys("list", "--json")
    for result in (listed, shown, as_json):
        assert result.exit_code == 0, result.stderr
        assert key[4:] not in result.stdout + result.stderr
        assert digest not in result.stdout + result.stderr
    assert name in listed.stdout and '"backends":["local"]' in listed.stdout
    assert json.loads(shown.stdout)["policy"]["backends"] == ["local"]
    assert any(json.loads(line)["name"] == name for line in as_json.stdout.splitlines())
    again = keys("add", name)
    assert again.exit_code == 2 and f"a key named {name!r} exists" in again.stderr


def test_rotation_keeps_the_sessions_and_the_old_key_stops_after_its_grace(
    governed_server: Server,
    keys: Callable[..., CliResult],
    add_key: Callable[..., str],
) -> None:
    name = unique_name("rotated")
    old = add_key(name, "--backends", "local")
    with governed_server.client(old) as api:
        created = api.post("/v1/sessions", json={"backend": "local"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).status_code == 200
    # With a grace period, both work for a while.
    graced = keys("rotate", name, "--grace-s", "60")
    assert graced.exit_code == 0, graced.stderr
    middle = graced.stdout.strip()
    assert middle.startswith("cir_") and middle != old
    assert eventually(lambda: status_of(governed_server, middle) == 200)
    assert status_of(governed_server, old) == 200
    # Without one, the earlier keys stop at once (within the service's second).
    rotated = keys("rotate", name)
    assert rotated.exit_code == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert eventually(lambda: status_of(governed_server, new) == 200)
    assert eventually(lambda: status_of(governed_server, old) == 401)
    assert status_of(governed_server, middle) == 401
    with governed_server.client(new) as api:
        # The same principal: its session, and its variables, are the new key's.
        assert [s["id"] for s in api.get("/v1/sessions").json()] == [sid]
        done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x + 1"})
        assert done.json()["results"][0]["text"] == "42"
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    with governed_server.client(old) as api:
        refused = api.get("/v1/sessions")
        assert refused.status_code == 401 and "invalid API key" in refused.text


def test_a_policy_set_by_the_cli_takes_effect_without_a_restart(
    governed_server: Server,
    keys: Callable[..., CliResult],
    add_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    name = unique_name("changed")
    key = add_key(name, "--backends", "docker")

    def create_local() -> int:
        with governed_server.client(key) as api:
            made = api.post("/v1/sessions", json={"backend": "local"})
            if made.status_code == 201:
                api.delete(f"/v1/sessions/{made.json()['id']}")
            return made.status_code

    assert create_local() == 403
    policy = tmp_path / "policy.toml"
    policy.write_text('backends = ["local"]\nmax_sessions = 3\n')
    changed = keys("set-policy", name, "--policy", str(policy))
    assert changed.exit_code == 0, changed.stderr
    assert '"backends": ["local"]' in changed.stdout
    assert eventually(lambda: create_local() == 201)
    shown = json.loads(keys("show", name).stdout)
    assert shown["policy"]["max_sessions"] == 3 and shown["admin"] is False
    # Flags change one rule and keep the others.
    assert keys("set-policy", name, "--no-commands", "--admin").exit_code == 0
    shown = json.loads(keys("show", name).stdout)
    assert shown["policy"]["commands"] is False and shown["policy"]["max_sessions"] == 3
    assert shown["admin"] is True
    assert eventually(lambda: _whoami(governed_server, key)["admin"] is True)

    # Each change is in the audit log, under the key's name and id, said by the CLI.
    async def read() -> list[AuditEvent]:
        store = local_store(governed_server.state_dir)
        try:
            return await store.audit.query_events(AuditQuery(principal=name))
        finally:
            await store.close()

    events = asyncio.run(read())
    changes = [e for e in events if e.kind.startswith("key.")]
    assert [e.kind for e in changes] == ["key.policy", "key.policy", "key.added"]
    assert {e.owner for e in events} == {shown["id"]}
    assert all(e.details["by"].startswith("cli:") for e in changes)
    assert changes[0].details["policy"]["commands"] is False and changes[0].details["admin"]
    # ... and so is the refusal the first policy made.
    denied = [e for e in events if e.kind == "policy.denied"]
    assert denied and denied[-1].details["rule"] == "backends"


def _whoami(server: Server, key: str) -> dict[str, object]:
    with server.client(key) as api:
        found: dict[str, object] = api.get("/v1/whoami").json()
        return found


@pytest.mark.parametrize(
    ("file_name", "text", "said"),
    [
        ("p.json", '{"backends": ["local"', "is not valid JSON"),
        ("p.toml", "backends = [local]", "is not valid TOML"),
        ("p.json", '["local"]', "must hold an object of rules"),
        ("p.json", '{"backend": ["local"]}', "backend: no such rule; rules are: backends"),
        ("p.json", '{"backends": ["dockr"]}', "backends: unknown backend 'dockr'"),
        ("p.json", '{"languages": ["cobol"]}', "languages: unknown language"),
        ("p.toml", "max_sessions = -1", "max_sessions: Input should be greater than or equal"),
        ("p.toml", "[max_limits]\nmemory_gb = 2", "max_limits: unknown limit 'memory_gb'"),
        ("p.toml", "[max_limits]\nmemory_mb = 1", "max_limits: memory_mb: Input should be"),
        ("p.json", '{"network": {"mode": "allow_list"}}', "network: an allow_list policy needs"),
        ("p.json", '{"commands": "sometimes"}', "commands: Input should be a valid boolean"),
    ],
)
def test_a_bad_policy_file_is_a_clear_error_naming_the_field(
    keys: Callable[..., CliResult], tmp_path: Path, file_name: str, text: str, said: str
) -> None:
    policy = tmp_path / file_name
    policy.write_text(text)
    name = unique_name("bad")
    result = keys("add", name, "--policy", str(policy))
    assert result.exit_code == 2
    assert said in result.stderr, result.stderr
    assert result.stdout == ""  # no key made, none printed
    assert keys("show", name).exit_code == 2


def test_usage_errors_say_what_to_do(keys: Callable[..., CliResult], tmp_path: Path) -> None:
    for bad in ("local", "key-0123abcd", "-x", "a b", "x" * 65):
        result = keys("add", bad)
        assert result.exit_code == 2, bad
        assert "cannot name a key" in result.stderr or "No such option" in result.stderr
    missing = keys("show", "no-such-key")
    assert missing.exit_code == 2 and "no key named 'no-such-key'" in missing.stderr
    nothing = keys("set-policy", "no-such-key")
    assert nothing.exit_code == 2 and "say what to change" in nothing.stderr
    absent = keys("add", unique_name("x"), "--policy", str(tmp_path / "absent.json"))
    assert absent.exit_code == 2 and "cannot read the policy file" in absent.stderr
    limit = keys("add", unique_name("x"), "--max-limit", "memory_mb")
    assert limit.exit_code == 2 and "write NAME=VALUE" in limit.stderr


def test_the_installed_command_lists_keys(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    """The real command, as an operator types it, in its own process."""
    name = unique_name("listed")
    add_key(name, "--no-commands")
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "keys", "list", "--state-dir",
         str(governed_server.state_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(row for row in done.stdout.splitlines() if row.startswith(name))
    assert "active" in line and '"commands":false' in line


def test_keys_held_through_rotations_in_grace_are_capped(keys: Callable[..., CliResult]) -> None:
    name = unique_name("often")
    assert keys("add", name).exit_code == 0
    latest = ""
    for _ in range(MAX_KEYS + 3):
        rotated = keys("rotate", name, "--grace-s", "3600")
        assert rotated.exit_code == 0, rotated.stderr
        latest = rotated.stdout.strip()
    shown = json.loads(keys("show", name).stdout)
    assert shown["keys"] == MAX_KEYS  # the newest, and the latest old ones in their grace
    assert latest[4:] not in json.dumps(shown)


def test_an_e2b_shaped_key_is_made_and_rotated_for_clients_that_check_the_shape(
    governed_server: Server,
    keys: Callable[..., CliResult],
    add_key: Callable[..., str],
) -> None:
    """E2B's older SDKs, and tools built on them, refuse a key not shaped `e2b_<40 hex>`
    before sending it: the CLI makes such keys, which work on every front."""
    shape = re.compile(r"e2b_[0-9a-f]{40}")
    name = unique_name("e2b-shaped")
    key = add_key(name, "--e2b-shaped")
    assert shape.fullmatch(key), key
    with httpx.Client(base_url=governed_server.url, headers={"X-API-Key": key}) as e2b:
        assert e2b.get("/sandboxes").status_code == 200  # E2B's control plane takes it
    rotated = keys("rotate", name, "--e2b-shaped")
    assert rotated.exit_code == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert shape.fullmatch(new) and new != key
    assert eventually(lambda: status_of(governed_server, new) == 200)
    assert eventually(lambda: status_of(governed_server, key) == 401)
    plain = keys("rotate", name)  # the shape is chosen at each rotation
    assert plain.exit_code == 0 and plain.stdout.strip().startswith("cir_"), plain.stderr
