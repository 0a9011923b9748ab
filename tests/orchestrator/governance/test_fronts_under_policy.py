"""The front doors under a key's policy, against a real `serve` whose network ceiling opens one
host: E2B's unmodified SDK reads a refusal as a refusal (not as a sandbox that is gone), E2B's
file calls outside the workspace are file operations (not the key's commands), a plain
`Sandbox.create()` gets the network the key's policy allows, and the console's login secret can
be shared by replicas (`console_secret`)."""

from __future__ import annotations

import secrets
import shutil
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b import SandboxException, SandboxNotFoundException, TimeoutException
from e2b_code_interpreter import Sandbox

from orchestrator.console.console_auth import COOKIE
from orchestrator.console.login_tokens import SECRET_FILE, LoginTokens, key_digest
from orchestrator.e2b_compatible.connect_calls import connect_errors
from orchestrator.governance.approval_errors import ApprovalsFull
from orchestrator.governance.errors import ApprovalDenied, PolicyDenied
from orchestrator.sessions import SessionBusy, SessionExpired, SessionNotFound
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.governance.conftest import KEY_A, eventually, run_keys, unique_name
from tests.orchestrator.service.conftest import Server, make_server

APPROVAL_TIMEOUT_S = 20  # what a call gated by mistake would wait before being denied
CONSOLE_SECRET = "shared-console-secret-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Local sessions only (governance is the same on every backend); a ceiling that opens
    allowed.test on the web ports; a console secret shared, as replicas would share it."""
    made = make_server(
        backends="local",
        default_backend="local",
        network_ceiling="allowed.test:80,allowed.test:443",
        egress_resolve="allowed.test=127.0.0.1",
        egress_private_hosts="allowed.test",
        approval_timeout_s=APPROVAL_TIMEOUT_S,
        console_secret=CONSOLE_SECRET,
    )
    made.start()
    try:
        yield made
    finally:
        made.stop()
        shutil.rmtree(made.state_dir.parent, ignore_errors=True)


def add_key(server: Server, *flags: str) -> tuple[str, str]:
    """(name, key) of a key made by the CLI, once the service takes it."""
    name = unique_name("front")
    made = run_keys(server, "add", name, *flags)
    assert made.exit_code == 0, made.stderr
    key = made.stdout.strip()
    with server.client(key) as api:
        assert eventually(lambda: api.get("/v1/whoami").status_code == 200)
    return name, key


@pytest.fixture
def made(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Sandbox]]:
    """The sandboxes a test made (each with the key point_sdk_at gave it), killed after it
    (before monkeypatch undoes the SDK's environment)."""
    made: list[Sandbox] = []
    yield made
    for sandbox in made:
        sandbox.kill()


def create(made: list[Sandbox], **options: object) -> Sandbox:
    sandbox = Sandbox.create(template="local", **options)
    made.append(sandbox)
    return sandbox


# --- refusals reach E2B's SDK as refusals
@pytest.mark.parametrize(
    ("error", "code"),
    [
        (PolicyDenied("key 'k' may not ..."), Code.PERMISSION_DENIED),
        (ApprovalDenied("denied by alice"), Code.PERMISSION_DENIED),
        (ApprovalsFull("too many wait"), Code.RESOURCE_EXHAUSTED),
        (SessionBusy("running code"), Code.FAILED_PRECONDITION),
        (SessionNotFound("no session s-1"), Code.UNAVAILABLE),  # the sandbox is gone
        (SessionExpired("session s-1 expired"), Code.UNAVAILABLE),
    ],
)
def test_a_session_error_gets_the_connect_code_of_what_it_says(
    error: Exception, code: Code
) -> None:
    with pytest.raises(ConnectError) as raised, connect_errors():
        raise error
    assert raised.value.code is code
    assert str(error) in raised.value.message
    gone = "was not found" in raised.value.message
    assert gone == (code is Code.UNAVAILABLE)  # only a gone sandbox says so


def test_a_refused_command_is_a_refusal_not_a_gone_sandbox(
    server: Server, made: list[Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, key = add_key(server, "--no-commands", "--languages", "python")
    point_sdk_at(monkeypatch, server.url, key)
    sandbox = create(made)
    with pytest.raises(SandboxException) as refused:
        sandbox.commands.run("echo hi")
    assert not isinstance(refused.value, SandboxNotFoundException | TimeoutException)
    message = str(refused.value)
    # E2B's SDK has no class for PERMISSION_DENIED: a SandboxException naming the code.
    assert "PERMISSION_DENIED" in message and f"key {name!r}" in message
    assert "`commands` is off" in message
    with pytest.raises(SandboxException) as bash:  # the REST side: 403, naming the rule
        sandbox.run_code("echo hi", language="bash")
    assert "403" in str(bash.value) and "`languages`" in str(bash.value)
    assert sandbox.is_running() and sandbox.run_code("6 * 7").text == "42"


# --- E2B's file calls outside the workspace are file operations
def test_file_calls_outside_the_workspace_are_not_the_keys_commands(
    server: Server, made: list[Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run by small commands inside the sandbox, they are neither refused by `commands: false`
    nor held for a human by `approve_commands` (held, each would wait APPROVAL_TIMEOUT_S); the
    key's own commands still are refused."""
    for flag in ("--no-commands", "--approve-commands"):
        _, key = add_key(server, flag)
        point_sdk_at(monkeypatch, server.url, key)
        sandbox = create(made)
        started = time.monotonic()
        sandbox.files.write("/tmp/in/a.txt", "hello")
        assert sandbox.files.read("/tmp/in/a.txt") == "hello"
        assert [e.name for e in sandbox.files.list("/tmp/in")] == ["a.txt"]
        sandbox.files.rename("/tmp/in/a.txt", "/tmp/in/b.txt")
        assert sandbox.files.get_info("/tmp/in/b.txt").size == 5
        sandbox.files.make_dir("/tmp/in/d")
        sandbox.files.remove("/tmp/in")
        assert not sandbox.files.exists("/tmp/in")
        assert time.monotonic() - started < APPROVAL_TIMEOUT_S / 2, flag  # nothing waited
    with pytest.raises(SandboxException) as refused:  # (the --no-commands key's sandbox)
        made[0].commands.run("echo hi")
    assert "`commands` is off" in str(refused.value)


def test_a_command_that_waits_past_its_timeout_is_withdrawn(
    server: Server, made: list[Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's SDK gives up on a command at its `timeout`: a request for approval the command is
    waiting on is withdrawn then, so an answer given later starts no process no one follows."""
    _, key = add_key(server, "--approve-commands")
    point_sdk_at(monkeypatch, server.url, key)
    sandbox = create(made)
    with pytest.raises(TimeoutException):
        sandbox.commands.run("echo never", timeout=2)
    with server.client(key) as api:

        def withdrawn() -> bool:
            found = api.get("/v1/approvals").json()
            return len(found) == 1 and found[0]["state"] == "expired"

        assert eventually(withdrawn, within_s=APPROVAL_TIMEOUT_S / 2)
        events = api.get("/v1/audit", params={"session_id": sandbox.sandbox_id}).json()["events"]
        assert "process.started" not in [e["kind"] for e in events]


def test_the_internal_process_tag_exempts_nothing(server: Server) -> None:
    """The exemption is the service's own parameter: a client that tags its process as the E2B
    front tags its file transfers is refused all the same."""
    _, key = add_key(server, "--no-commands")
    with server.client(key) as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        try:
            for path, body in (
                ("processes", {"command": "echo hi", "tag": "cir-e2b-internal:x"}),
                ("commands", {"command": "echo hi", "tag": "cir-e2b-internal:x"}),
            ):
                refused = api.post(f"/v1/sessions/{sid}/{path}", json=body)
                assert refused.status_code == 403, (path, refused.text)
                assert refused.json()["error"]["type"] == "PolicyDenied"
        finally:
            api.delete(f"/v1/sessions/{sid}")


# --- the network E2B asks for by default fits the key's policy
def test_a_plain_create_gets_the_network_the_policy_allows(
    server: Server, made: list[Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    point_sdk_at(monkeypatch, server.url, KEY_A)  # no network rule: the operator's internet
    assert create(made).get_info().allow_internet_access is True
    name, key = add_key(server, "--network", "none")
    point_sdk_at(monkeypatch, server.url, key)
    assert create(made).get_info().allow_internet_access is False
    assert create(made, allow_internet_access=True).get_info().allow_internet_access is False
    with pytest.raises(SandboxException) as refused:  # asked for by name: refused, told why
        create(made, network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
    assert "403" in str(refused.value) and f"key {name!r}" in str(refused.value)
    assert "`network`" in str(refused.value)


# --- the console's login secret, shared by replicas
def test_a_shared_console_secret_makes_logins_hold_on_every_replica(server: Server) -> None:
    shared = LoginTokens(CONSOLE_SECRET.encode())
    with httpx.Client(base_url=server.url, timeout=60) as browser:
        assert browser.post("/console/login", data={"key": KEY_A}).status_code == 303
        made_here = browser.cookies.get(COOKIE)
        assert made_here is not None and shared.read(made_here) is not None
    assert not (server.state_dir / SECRET_FILE).exists()  # the setting's, not a file's
    with httpx.Client(base_url=server.url, timeout=60) as api:
        principal_id = api.get("/v1/whoami", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    # A login another replica made (the same secret) is taken here.
    elsewhere = shared.issue(str(principal_id["id"]), key_digest(KEY_A))
    with httpx.Client(base_url=server.url, timeout=60) as other_browser:
        page = other_browser.get("/console/sessions", headers={"Cookie": f"{COOKIE}={elsewhere}"})
        assert page.status_code == 200 and 'id="sessions-list"' in page.text
        forged = LoginTokens(uuid.uuid4().hex.encode() * 2).issue("x", key_digest(KEY_A))
        refused = other_browser.get("/console/sessions", headers={"Cookie": f"{COOKIE}={forged}"})
        assert refused.status_code == 303
