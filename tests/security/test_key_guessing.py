"""Key guessing is throttled (issue 28, item 6): a real `serve` on 127.0.0.1, clients bound to
addresses of their own on the loopback network (127.0.0.2, ...), so that the server tells them
apart as it tells machines apart. An address past its budget of wrong keys is answered 429 with
Retry-After, unchecked, on every front (REST, E2B's API, a terminal's WebSocket, the console's
login), and logged; meanwhile the right key from an address that sent no wrong key is let in
every time."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from orchestrator.config import Settings
from tests.orchestrator.service.conftest import KEY_A, Server, make_server

PER_ADDRESS = Settings.model_fields["auth_failures_per_minute"].default  # 20
PER_PREFIX = 10
WINDOW_S = 60  # the throttle's window: counts per minute, windows starting on the minute


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server of its own, its budgets fresh: the default per address, a small per prefix."""
    srv = make_server(
        auth_failures_per_minute=PER_ADDRESS, auth_failures_per_minute_per_key_prefix=PER_PREFIX
    ).start()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def client_from(server: Server, address: str, key: str | None) -> httpx.Client:
    """A client of the server whose connections come from `address` (on 127.0.0.0/8)."""
    return server.client(key, transport=httpx.HTTPTransport(local_address=address))


def wrong_key() -> str:
    return f"wrong-{uuid.uuid4().hex}"


def within_one_window() -> None:
    """Until a minute's window of the throttle's counters has at least 40 s left: its sliding
    window counter weighs the window before by how much of the current one is left, so a
    burst that straddles two windows regains tries within seconds of its last refusal (one
    each 60/budget s, as designed). In one window, what it refused stays refused to its end."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < 40:
        time.sleep(left + 0.1)


def test_a_burst_of_wrong_keys_ends_in_429_and_the_right_key_still_gets_in(
    server: Server,
) -> None:
    guesser, owner = "127.0.0.2", "127.0.0.3"
    statuses: list[int] = []
    within_one_window()
    with client_from(server, owner, KEY_A) as right:
        for _ in range(PER_ADDRESS + 10):
            with client_from(server, guesser, wrong_key()) as wrong:
                answer = wrong.get("/v1/whoami")
            statuses.append(answer.status_code)
            # The owner, from an address that sends no wrong keys, is never held back.
            mine = right.get("/v1/whoami")
            assert mine.status_code == 200, mine.text
    # Never refused before its budget is spent; refused once it is (the sliding window may
    # let one more through right at a minute's edge).
    assert statuses[:PER_ADDRESS] == [401] * PER_ADDRESS, statuses
    assert statuses.count(401) <= PER_ADDRESS + 1 and statuses[-5:] == [429] * 5, statuses
    with client_from(server, guesser, wrong_key()) as wrong:
        refused = wrong.get("/v1/whoami")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 61  # a minute, and a second of margin
    assert refused.json()["error"]["type"] == "TooManyWrongKeys"
    assert "too many wrong keys from this address" in refused.json()["error"]["message"]
    # Unchecked: the right key from the guessing address is refused too, until it slows down.
    with client_from(server, guesser, KEY_A) as same_address:
        assert same_address.get("/v1/whoami").status_code == 429
    log = server.log.read_text()
    assert f"key guessing: {guesser} sent {PER_ADDRESS} wrong keys within a minute" in log
    assert log.count(f"key guessing: {guesser} sent") == 1  # once, not once per refusal

    # Every front counts against the same budget and answers in its own shape.
    with client_from(server, guesser, None) as e2b:
        control = e2b.get("/sandboxes", headers={"X-API-Key": wrong_key()})
    assert control.status_code == 429 and control.json()["code"] == 429
    assert "retry-after" in control.headers
    with (
        connect(
            server.url.replace("http://", "ws://") + "/v1/sessions/s-none/terminal",
            additional_headers={"Authorization": f"Bearer {wrong_key()}"},
            source_address=(guesser, 0),
            proxy=None,
        ) as terminal,
        pytest.raises(ConnectionClosed) as closed,
    ):
        while True:
            terminal.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4429


def test_guesses_at_one_key_spread_over_addresses_are_slowed_but_its_owner_gets_in(
    server: Server,
) -> None:
    prefix = KEY_A[:8]
    spread = [f"127.0.1.{i}" for i in range(1, PER_PREFIX + 1)]
    within_one_window()
    for address in spread:  # one wrong key each, all starting like KEY_A: each is checked
        with client_from(server, address, prefix + uuid.uuid4().hex) as wrong:
            assert wrong.get("/v1/whoami").status_code == 401
    # An address that has been failing is refused such keys now, unchecked...
    with client_from(server, spread[0], prefix + uuid.uuid4().hex) as again:
        refused = again.get("/v1/whoami")
    assert refused.status_code == 429 and "retry-after" in refused.headers
    assert "starting like this one" in refused.json()["error"]["message"]
    # ...but other keys it sends are still checked,
    with client_from(server, spread[0], wrong_key()) as other:
        assert other.get("/v1/whoami").status_code == 401
    # and the key's owner, from an address that sent no wrong key, gets in at once.
    with client_from(server, "127.0.1.200", KEY_A) as owner:
        assert owner.get("/v1/whoami").status_code == 200


def test_wrong_console_logins_are_throttled_the_same_way(server: Server) -> None:
    guesser, owner = "127.0.2.1", "127.0.2.2"
    statuses = []
    within_one_window()
    with (
        client_from(server, guesser, None) as wrong,
        client_from(server, owner, None) as right,
    ):
        for _ in range(PER_ADDRESS + 5):
            login = wrong.post("/console/login", data={"key": wrong_key()})
            statuses.append(login.status_code)
            mine = right.post("/console/login", data={"key": KEY_A})
            assert mine.status_code == 303 and "cir_console" in mine.cookies, mine.text
            right.cookies.clear()
        refused = wrong.post("/console/login", data={"key": wrong_key()})
    assert statuses[:PER_ADDRESS] == [401] * PER_ADDRESS, statuses
    assert statuses[-3:] == [429] * 3, statuses
    assert (
        refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 61
    )  # a minute, and a second of margin
    assert "Too many wrong keys from your address" in refused.text
    assert f"key guessing: {guesser} sent {PER_ADDRESS} wrong keys" in server.log.read_text()


def test_behind_a_trusted_proxy_the_client_it_names_is_counted_not_the_proxy(
    server: Server,
) -> None:
    """Through a reverse proxy every connection comes from the proxy: counted by the proxy's
    address, one guesser would lock every client out. A proxy in `forwarded_allow_ips` (by
    default 127.0.0.1) names the client in X-Forwarded-For, and that client is counted; a
    client that is no trusted proxy cannot dodge its budget by naming others. The addresses
    named are only header values: nothing is dialled."""
    proxy, spoofer = "127.0.0.1", "127.0.0.4"
    statuses: list[int] = []
    with client_from(server, proxy, KEY_A) as right:
        for _ in range(PER_ADDRESS + 5):
            with client_from(server, proxy, wrong_key()) as wrong:
                answer = wrong.get("/v1/whoami", headers={"X-Forwarded-For": "203.0.113.9"})
            statuses.append(answer.status_code)
            mine = right.get("/v1/whoami", headers={"X-Forwarded-For": "203.0.113.10"})
            assert mine.status_code == 200, mine.text
    assert statuses[-3:] == [429] * 3, statuses
    assert f"key guessing: 203.0.113.9 sent {PER_ADDRESS} wrong keys" in server.log.read_text()
    statuses.clear()
    for i in range(PER_ADDRESS + 5):
        with client_from(server, spoofer, wrong_key()) as wrong:
            answer = wrong.get("/v1/whoami", headers={"X-Forwarded-For": f"198.51.100.{i}"})
        statuses.append(answer.status_code)
    assert statuses[-3:] == [429] * 3, statuses


def guessed_signature() -> str:
    """Shaped as E2B's (`v1_` and 43 base64 characters), so that it is looked for."""
    return "v1_" + base64.b64encode(os.urandom(32)).rstrip(b"=").decode()


def test_guessed_signatures_of_file_urls_are_throttled_like_wrong_keys(server: Server) -> None:
    """A signed-URL signature that opens no sandbox (each costs a hash per sandbox) counts as
    a wrong key from its address: past the budget, the next are refused unchecked (429)."""
    with server.client() as api:  # E2B's API takes a bearer key too
        made = api.post("/sandboxes", json={"templateID": "local"})
        assert made.status_code == 201, made.text
        try:
            with client_from(server, "127.0.0.9", None) as guesser:
                statuses = [
                    guesser.get(
                        "/files",
                        params={"path": "x.txt", "signature": guessed_signature()},
                    ).status_code
                    for _ in range(PER_ADDRESS + 5)
                ]
        finally:
            api.delete(f"/sandboxes/{made.json()['sandboxID']}")
    assert set(statuses[:PER_ADDRESS]) == {401} and statuses[-1] == 429, statuses
