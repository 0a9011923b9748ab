"""The console over HTTP, against a real `serve` (the governance tests' server): its login and
cookie, its headers, CSRF, who sees what, an execution's code and capped output, approvals
answered through it, the audit log's filters, and a revoked or rotated key logged out at once.
The browser's view of the same is in test_console_browser.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.console.console_auth import COOKIE, MAX_KEY_CHARS
from orchestrator.console.headers import CONTENT_SECURITY_POLICY
from orchestrator.console.login_tokens import LoginTokens, key_digest, load_secret
from orchestrator.console.shown_outputs import SHOWN_CHARS
from orchestrator.governance.approvals import MAX_REASON_CHARS
from tests.orchestrator.governance.conftest import (
    ADMIN_KEY,
    KEY_A,
    KEY_B,
    CliResult,
    eventually,
    unique_name,
)
from tests.orchestrator.service.conftest import Server

# A 1x1 PNG the code shows with IPython.display.
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
        "0000000d49444154789c6360f8cfc0f01f0005000201e2d3ad8e0000000049454e44ae426082"
    )
).decode()


@contextmanager
def console(server: Server, key: str | None = None) -> Iterator[httpx.Client]:
    """A browser-like client of the console: keeps its cookie; logged in with `key`."""
    with httpx.Client(base_url=server.url, timeout=120, follow_redirects=False) as client:
        if key is not None:
            answer = client.post("/console/login", data={"key": key})
            assert answer.status_code == 303, answer.text
        yield client


def with_cookie(server: Server, path: str, token: str) -> httpx.Response:
    """GET a console page with this cookie alone (a copied or forged one)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.get(path, headers={"Cookie": f"{COOKIE}={token}"})


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, "no CSRF token in the page"
    return found.group(1)


def poll_version(html: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}" hx-get="[^"]*\?v=([0-9a-f]+)"', html)
    assert found is not None, f"no polled block {element_id} in the page"
    return found.group(1)


def test_login_sets_a_strict_cookie_and_every_page_a_strict_policy(
    governed_server: Server,
) -> None:
    with console(governed_server) as browser:
        form = browser.get("/console/login")
        assert form.status_code == 200 and 'name="key"' in form.text
        for name, value in {
            "content-security-policy": CONTENT_SECURITY_POLICY,
            "x-frame-options": "DENY",
            "cache-control": "no-store",
            "x-content-type-options": "nosniff",
        }.items():
            assert form.headers[name] == value
        assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
        assert (
            browser.get("/console/sessions").headers["location"].endswith("/console/login?why=none")
        )
        wrong = browser.post("/console/login", data={"key": "not-a-key"})
        assert wrong.status_code == 401 and "does not work here" in wrong.text
        assert COOKIE not in wrong.headers.get("set-cookie", "")
        logged_in = browser.post("/console/login", data={"key": KEY_A})
        assert logged_in.status_code == 303
        assert logged_in.headers["location"].endswith("/console/sessions")
        cookie = logged_in.headers["set-cookie"].lower()
        for flag in ("httponly", "samesite=strict", "path=/console"):
            assert flag in cookie
        assert KEY_A.lower() not in cookie  # the key itself is never kept
        # Nor its digest, which would let a weak key be guessed offline from a leaked cookie.
        token = browser.cookies.get(COOKIE) or ""
        assert token.startswith("v3.") and key_digest(KEY_A) not in token
        body = base64.urlsafe_b64decode(token.split(".")[1] + "==")
        assert key_digest(KEY_A).encode() not in body
        assert hashlib.sha256(KEY_A.encode()).digest() not in body
        page = browser.get("/console/sessions")
        assert page.status_code == 200 and 'id="sessions-list"' in page.text


def test_pages_load_nothing_from_another_origin(governed_server: Server) -> None:
    with console(governed_server, ADMIN_KEY) as browser:
        for path in ("/console/login", "/console/sessions", "/console/approvals", "/console/audit"):
            html = browser.get(path).text
            assert "http://" not in html and "https://" not in html, path
            for url in re.findall(r'(?:src|href|action)="([^"]*)"', html):
                assert url.startswith("/console/") or url == "data:,", (path, url)
        htmx = browser.get("/console/static/htmx.min.js")
        assert htmx.status_code == 200 and "javascript" in htmx.headers["content-type"]
        assert "htmx" in htmx.text
        css = browser.get("/console/static/pico.min.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        readme = Path(__file__).parents[3] / "orchestrator/console/static/README.md"
        assert "2.0.11" in readme.read_text() and "2.1.1" in readme.read_text()


def test_forms_need_this_logins_token_and_this_origin(governed_server: Server) -> None:
    with console(governed_server, KEY_A) as mine, console(governed_server, KEY_B) as theirs:
        token = csrf_of(mine.get("/console/sessions").text)
        other = csrf_of(theirs.get("/console/sessions").text)
        assert token != other
        for data, headers in (
            ({}, {}),
            ({"csrf": "forged"}, {}),
            ({"csrf": other}, {}),  # another login's token
            ({"csrf": token}, {"Origin": "http://elsewhere.example"}),
        ):
            refused = mine.post("/console/logout", data=data, headers=headers)
            assert refused.status_code == 403, data
            assert "reload the page" in refused.text
        assert mine.get("/console/sessions").status_code == 200  # still logged in
        copied = mine.cookies.get(COOKIE)
        out = mine.post("/console/logout", data={"csrf": token})
        assert out.status_code == 303 and out.headers["location"].endswith("why=out")
        assert mine.get("/console/sessions").status_code == 303
        # A copy of the cookie kept from before the logout no longer works either.
        copy = with_cookie(governed_server, "/console/sessions", copied or "")
        assert copy.headers["location"].endswith("why=out")


def test_a_tampered_cookie_or_an_overlong_key_is_refused(governed_server: Server) -> None:
    with console(governed_server, KEY_A) as browser:
        token = browser.cookies.get(COOKIE) or ""
        assert with_cookie(governed_server, "/console/sessions", token).status_code == 200
        version, sealed = token.split(".", 1)
        raw = bytearray(base64.urlsafe_b64decode(sealed + "=="))
        raw[40] ^= 1  # one bit of the ciphertext flipped
        forged = f"{version}.{base64.urlsafe_b64encode(bytes(raw)).decode()}"
        for bad in (forged, "x" * 5000, token[:-2]):
            refused = with_cookie(governed_server, "/console/sessions", bad)
            assert refused.headers["location"].endswith("why=expired")
        too_long = browser.post("/console/login", data={"key": "k" * (MAX_KEY_CHARS + 1)})
        assert too_long.status_code == 401
        assert f"at most {MAX_KEY_CHARS} characters" in too_long.text


def test_login_tokens_expire_and_are_bound_to_their_secret(tmp_path: Path) -> None:
    secret = load_secret(tmp_path)
    assert load_secret(tmp_path) == secret  # kept: a restart keeps everyone logged in
    assert stat.S_IMODE(os.stat(tmp_path / "console-secret").st_mode) == 0o600
    tokens = LoginTokens(secret, ttl_s=60)
    token = tokens.issue("p_1", "d" * 64, now=1000.0)
    login = tokens.read(token, now=1059.0)
    assert login is not None and login.principal_id == "p_1"
    assert tokens.read(token, now=1061.0) is None
    assert LoginTokens(b"s" * 32).read(token, now=1000.0) is None
    other = tokens.read(tokens.issue("p_1", "d" * 64, now=1000.0), now=1000.0)
    assert other is not None and tokens.csrf(login) != tokens.csrf(other)
    assert tokens.csrf_ok(login, tokens.csrf(login)) and not tokens.csrf_ok(login, "é")


def test_a_login_token_carries_its_keys_digest_sealed(tmp_path: Path) -> None:
    """Only the secret opens it (a Fernet token, its key derived from the secret): no two
    logins' tokens can be compared, a token made with another secret is refused, and the old
    kinds (v1: the digest in the clear; v2: sealed by hand) too."""
    digest = key_digest("weak-key")
    tokens = LoginTokens(load_secret(tmp_path))
    made = [tokens.issue("p_1", digest) for _ in range(2)]
    for token in made:
        body = base64.urlsafe_b64decode(token.split(".", 1)[1] + "==")
        assert digest.encode() not in body and bytes.fromhex(digest) not in body
        assert b"p_1" not in body  # sealed whole, not only the digest
        login = tokens.read(token)
        assert login is not None and login.key_digest == digest  # the server opens it
    assert made[0] != made[1]
    assert LoginTokens(b"o" * 32).read(made[0]) is None
    tampered = made[0][:-6] + ("A" if made[0][-6] != "A" else "B") + made[0][-5:]
    assert tokens.read(tampered) is None
    without_key = tokens.read(tokens.issue("local", ""))  # auth off: no key, nothing sealed
    assert without_key is not None and without_key.key_digest == ""
    with pytest.raises(ValueError, match="SHA-256"):
        tokens.issue("p_1", "abc")
    clear = json.dumps({"p": "p_1", "k": digest, "e": time.time() + 60, "n": "n" * 32})
    old_body = base64.urlsafe_b64encode(clear.encode()).rstrip(b"=").decode()
    for version in ("v1", "v2"):  # the old kinds open nothing
        assert tokens.read(f"{version}.{old_body}.c2lnbmF0dXJl") is None
        assert tokens.read(f"{version}.{made[0].split('.', 1)[1]}") is None


def test_each_key_sees_its_own_sessions_and_an_admin_all(
    governed_server: Server, api: Callable[[str], httpx.Client]
) -> None:
    owner = api(KEY_A)
    sid = owner.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    code = (
        "import base64\nfrom IPython.display import Image, display\n"
        f"display(Image(base64.b64decode('{PNG}')))"
    )
    shown = owner.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()
    assert shown["status"] == "ok", shown
    with (
        console(governed_server, KEY_A) as mine,
        console(governed_server, KEY_B) as theirs,
        console(governed_server, ADMIN_KEY) as admin,
    ):
        assert sid in mine.get("/console/sessions").text
        assert sid not in theirs.get("/console/sessions").text
        # The activity is the audit log's, written a moment after the execution ends.
        assert eventually(lambda: "<img" in mine.get(f"/console/sessions/{sid}").text)
        page = mine.get(f"/console/sessions/{sid}").text
        image = re.search(r'<img class="artifact" src="([^"]+)"', page)
        assert image is not None, page
        assert mine.get(image.group(1)).content == base64.b64decode(PNG)
        for path in (
            f"/console/sessions/{sid}",
            image.group(1),
            "/console/sessions/s-" + "x" * 3000,
        ):
            assert theirs.get(path).status_code == 404  # as if it did not exist
        listed = admin.get("/console/sessions").text
        assert sid in listed and "key-" in listed  # the owner's key by name
        assert admin.get(f"/console/sessions/{sid}").status_code == 200
        assert admin.get(image.group(1)).status_code == 200


def test_a_session_page_shows_code_and_capped_output_and_new_executions(
    governed_server: Server, api: Callable[[str], httpx.Client]
) -> None:
    owner = api(KEY_A)
    sid = owner.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    code = "print('<b>not bold</b>'); print('x' * 100_000)\n" + "#" * 10_000
    assert owner.post(f"/v1/sessions/{sid}/execute", json={"code": code}).status_code == 200
    with console(governed_server, KEY_A) as browser:
        assert eventually(lambda: "not bold" in browser.get(f"/console/sessions/{sid}").text)
        page = browser.get(f"/console/sessions/{sid}").text
        assert "&lt;b&gt;not bold&lt;/b&gt;" in page and "<b>not bold" not in page  # shown, not run
        assert "print(&#39;x&#39; * 100_000)" in page
        assert f"{100_000 + 17 - SHOWN_CHARS} more characters of stdout not shown" in page
        assert f"{len(code) - SHOWN_CHARS} more characters of code not shown" in page
        assert len(page) < 4 * SHOWN_CHARS  # a page stays small whatever the output
        version = poll_version(page, "activity")
        unchanged = browser.get(f"/console/sessions/{sid}/activity", params={"v": version})
        assert unchanged.status_code == 204  # the page keeps what its reader has open
        owner.post(f"/v1/sessions/{sid}/execute", json={"code": "print('the second run')"})

        def shows_the_second() -> bool:
            poll = browser.get(f"/console/sessions/{sid}/activity", params={"v": version})
            return poll.status_code == 200 and "the second run" in poll.text

        assert eventually(shows_the_second)


def pending_of(page: str, session_id: str) -> list[str]:
    """The ids of the waiting requests of one session on the approvals page (other tests'
    may wait there too)."""
    articles = re.findall(r'<article class="approval pending".*?</article>', page, re.S)
    return [
        re.findall(r'data-approval="([^"]+)"', article)[0]
        for article in articles
        if session_id in article
    ]


def _run_in_background(client: httpx.Client, sid: str, code: str) -> dict[str, Any]:
    """Start an execution that will wait for a human; its answer lands in the dict."""
    done: dict[str, Any] = {}

    def run() -> None:
        done["answer"] = client.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    done["thread"] = thread
    return done


def test_approvals_are_answered_in_the_console(
    governed_server: Server,
    api: Callable[[str], httpx.Client],
    add_key: Callable[..., str],
) -> None:
    name = unique_name("agent")
    agent_key = add_key(name, "--tools", "add", "--approval-tools", "add")
    agent = api(agent_key)
    sid = agent.post("/v1/sessions", json={"backend": "local", "tools": ["add"]}).json()["id"]
    code = (
        "import host_tools\ntry:\n    print(await host_tools.add(20, b=22))\n"
        "except host_tools.ToolDenied as e:\n    print('denied:', e)"
    )
    with console(governed_server, agent_key) as own, console(governed_server, ADMIN_KEY) as admin:
        for answer, reason in (("deny", "not today"), ("approve", "fine")):
            run = _run_in_background(agent, sid, code)
            assert eventually(lambda: bool(pending_of(admin.get("/console/approvals").text, sid)))
            page = admin.get("/console/approvals").text
            approval_id = pending_of(page, sid)[0]
            assert name in page and sid in page and "host_tools.add(20, b=22)" in page
            assert "&#34;a&#34;: 20" in page  # its arguments
            # Its own key may see it, not answer it (no self_approve).
            mine = own.get("/console/approvals").text
            assert approval_id in mine and f"approve-{approval_id}" not in mine
            refused = own.post(
                f"/console/approvals/{approval_id}",
                data={"decision": "approve", "csrf": csrf_of(mine)},
            )
            assert refused.status_code == 403 and "self_approve" in refused.text
            token = csrf_of(page)
            too_long = admin.post(
                f"/console/approvals/{approval_id}",
                data={"decision": answer, "reason": "r" * (MAX_REASON_CHARS + 1), "csrf": token},
            )
            assert too_long.status_code == 400 and "shorten it" in too_long.text
            decided = admin.post(
                f"/console/approvals/{approval_id}",
                data={"decision": answer, "reason": reason, "csrf": token},
            )
            assert decided.status_code == 303
            run["thread"].join(60)
            stdout = run["answer"]["stdout"]
            if answer == "approve":
                assert stdout == "42\n"
            else:  # the code got ToolDenied, with the reason
                assert stdout.startswith("denied:") and "not today" in stdout
            again = admin.post(
                f"/console/approvals/{approval_id}",
                data={"decision": "approve", "csrf": token},
            )
            assert again.status_code == 409
            table = admin.get("/console/approvals").text
            assert re.search(rf'data-approval="{approval_id}">.*?{reason}', table, re.S)


def test_the_audit_log_is_filtered_and_paged(
    governed_server: Server, api: Callable[[str], httpx.Client]
) -> None:
    owner = api(KEY_B)
    sid = owner.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    for n in range(55):
        uploaded = owner.post(f"/v1/sessions/{sid}/files", files={"file": (f"f{n}.txt", b"x")})
        assert uploaded.status_code in (200, 201), uploaded.text
    with console(governed_server, KEY_B) as mine, console(governed_server, ADMIN_KEY) as admin:

        def uploads(client: httpx.Client, **params: str) -> str:
            return client.get("/console/audit", params={"session": sid, **params}).text

        def all_logged() -> bool:  # the log is written a moment after each upload
            found = owner.get("/v1/audit", params={"session_id": sid, "kind": "file.upload"})
            return len(found.json()["events"]) == 55

        assert eventually(all_logged)
        first = uploads(mine, kind="file.upload")
        assert first.count('data-kind="file.upload"') == 50
        older = re.search(r'href="([^"]+)" id="older"', first)
        assert older is not None
        rest = mine.get(older.group(1).replace("&amp;", "&")).text
        assert rest.count('data-kind="file.upload"') == 5 and 'id="older"' not in rest
        assert 'data-kind="session.created"' not in first
        # A key filter is an admin's: from another key, it is ignored (its own are shown).
        assert 'data-kind="session.created"' in uploads(mine, key="nobody", kind="session.created")
        assert 'id="filter-key"' not in first and 'id="filter-key"' in uploads(admin)
        assert 'id="no-events"' in uploads(admin, key="nobody")
        assert uploads(admin, kind="file.upload").count('data-kind="file.upload"') == 50
        bad = mine.get("/console/audit", params={"since": "yesterday"})
        assert bad.status_code == 400 and "is not a time" in bad.text
        unknown = mine.get("/console/audit", params={"kind": "nonsense"})
        assert unknown.status_code == 400 and "no kind of event" in unknown.text
        future = uploads(mine, since="2999-01-01T00:00:00")
        assert 'id="no-events"' in future


def test_a_revoked_or_rotated_key_is_logged_out_at_once(
    governed_server: Server,
    add_key: Callable[..., str],
    keys: Callable[..., CliResult],
) -> None:
    name = unique_name("watcher")
    key = add_key(name)
    with console(governed_server, key) as browser:
        assert browser.get("/console/sessions").status_code == 200
        rotated = keys("rotate", name)
        assert rotated.exit_code == 0, rotated.stderr
        new_key = rotated.stdout.strip()

        def logged_out(why: str) -> bool:
            answer = browser.get("/console/sessions")
            return answer.status_code == 303 and answer.headers["location"].endswith(why)

        assert eventually(lambda: logged_out("why=revoked"), within_s=5)
        assert browser.post("/console/login", data={"key": key}).status_code == 401
        assert browser.post("/console/login", data={"key": new_key}).status_code == 303
        poll = browser.get("/console/sessions/list", headers={"HX-Request": "true"})
        assert poll.status_code == 200  # logged in again
        assert keys("revoke", name).exit_code == 0

        def told_to_leave() -> bool:
            answer = browser.get("/console/sessions/list", headers={"HX-Request": "true"})
            where: str = answer.headers.get("hx-redirect", "")
            return where.endswith("/console/login?why=revoked")

        assert eventually(told_to_leave, within_s=5)  # a polled part sends the page away
        assert browser.post("/console/login", data={"key": new_key}).status_code == 401
