"""The credential vault through a real server on 127.0.0.1 (local backend): secrets stored,
listed, read and deleted per key, refused typed when malformed, sealed at rest; and a session
asking for them sees only placeholders."""

from __future__ import annotations

import json
import shutil
import signal
import stat
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import require_backend
from tests.orchestrator.service.conftest import KEY_B, Server, make_server

VALUE = "sk-live-9f3c1e2d7b5a4c8e-do-not-leak"  # unique: searched for in files and outputs


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_backend("local")
    srv = make_server(backends="local", default_backend="local", network_ceiling="any")
    srv.start()
    try:
        yield srv
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)
        log = srv.log.read_text()
        assert VALUE not in log, "a secret's value was logged"
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client
        for secret in client.get("/v1/secrets").json()["secrets"]:
            client.delete(f"/v1/secrets/{secret['name']}")


def store(api: httpx.Client, name: str = "API_KEY", **more: object) -> httpx.Response:
    return api.post(
        "/v1/secrets", json={"name": name, "value": VALUE, "hosts": ["api.example.com"], **more}
    )


def error_type(reply: httpx.Response) -> str:
    return str(reply.json()["error"]["type"])


def test_store_list_get_replace_delete_never_answer_the_value(api: httpx.Client) -> None:
    stored = store(api, methods=["POST", "GET"], path_prefixes=["/v1/"])
    assert stored.status_code == 201, stored.text
    info = stored.json()
    assert VALUE not in stored.text
    assert info["name"] == "API_KEY" and info["hosts"] == ["api.example.com"]
    assert info["methods"] == ["GET", "POST"] and info["path_prefixes"] == ["/v1/"]
    assert info["headers"] == ["authorization", "x-api-key", "api-key"]  # the default
    assert info["placeholder"] == "cir-secret://API_KEY"

    listed = api.get("/v1/secrets")
    assert listed.status_code == 200 and VALUE not in listed.text
    assert [s["name"] for s in listed.json()["secrets"]] == ["API_KEY"]
    got = api.get("/v1/secrets/API_KEY")
    assert got.status_code == 200 and got.json()["hosts"] == ["api.example.com"]

    # The same name again replaces it (200), keeping when it was first stored.
    again = api.post(
        "/v1/secrets",
        json={
            "name": "API_KEY",
            "value": VALUE + "2",
            "hosts": ["*.Example.COM"],
            "headers": ["X-Goog-Api-Key"],
        },
    )
    assert again.status_code == 200, again.text
    assert again.json()["hosts"] == ["*.example.com"]
    assert again.json()["headers"] == ["x-goog-api-key"]
    assert api.get("/v1/secrets/API_KEY").json()["headers"] == ["x-goog-api-key"]
    assert again.json()["created_at"] == info["created_at"]

    assert api.delete("/v1/secrets/API_KEY").status_code == 204
    missing = api.get("/v1/secrets/API_KEY")
    assert missing.status_code == 404 and error_type(missing) == "SecretNotFound"
    assert api.delete("/v1/secrets/API_KEY").status_code == 404


def test_another_keys_secret_is_invisible(server: Server, api: httpx.Client) -> None:
    assert store(api).status_code == 201
    with server.client(KEY_B) as other:
        assert other.get("/v1/secrets").json() == {"secrets": []}
        for reply in (other.get("/v1/secrets/API_KEY"), other.delete("/v1/secrets/API_KEY")):
            assert reply.status_code == 404 and error_type(reply) == "SecretNotFound"
        # Its own of the same name is its own.
        mine = other.post(
            "/v1/secrets", json={"name": "API_KEY", "value": "b-value", "hosts": ["b.example"]}
        )
        assert mine.status_code == 201
        assert other.delete("/v1/secrets/API_KEY").status_code == 204
    assert api.get("/v1/secrets/API_KEY").json()["hosts"] == ["api.example.com"]


@pytest.mark.parametrize(
    "body",
    [
        {"name": "lower", "value": "v", "hosts": ["a.example"]},
        {"name": "1ABC", "value": "v", "hosts": ["a.example"]},
        {"name": "A" * 65, "value": "v", "hosts": ["a.example"]},
        {"name": "OK", "value": "v" * 8193, "hosts": ["a.example"]},
        {"name": "OK", "value": "", "hosts": ["a.example"]},
        {"name": "OK", "value": "line\nbreak", "hosts": ["a.example"]},
        {"name": "OK", "value": " padded", "hosts": ["a.example"]},
        {"name": "OK", "value": "v", "hosts": []},
        {"name": "OK", "value": "v", "hosts": ["*"]},
        {"name": "OK", "value": "v", "hosts": ["10.0.0.0/8"]},
        {"name": "OK", "value": "v", "hosts": ["bad host"]},
        {"name": "OK", "value": "v", "hosts": [f"h{i}.example" for i in range(17)]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "methods": ["get me"]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "path_prefixes": ["no-slash"]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "headers": []},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "headers": ["bad header"]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "headers": ["h" * 65]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "headers": ["Host"]},
        {"name": "OK", "value": "v", "hosts": ["a.example"], "headers": ["content-length"]},
        {
            "name": "OK",
            "value": "v",
            "hosts": ["a.example"],
            "headers": [f"x-{i}" for i in range(17)],
        },
        {"name": "OK"},
    ],
)
def test_malformed_input_is_refused_typed_and_never_echoes_the_value(
    api: httpx.Client, body: dict[str, object]
) -> None:
    reply = api.post("/v1/secrets", json=body)
    assert reply.status_code == 422, reply.text
    assert error_type(reply) == "InvalidRequest"
    value = body.get("value")
    if isinstance(value, str) and len(value) > 3:
        assert value not in reply.text
    assert api.get("/v1/secrets").json() == {"secrets": []}


@pytest.mark.parametrize(
    "host",
    [
        "*.com",
        "*.co.uk",
        "*.amazonaws.com",
        "*.github.io",
        "*.herokuapp.com",
        "*.blob.core.windows.net",
    ],
)
def test_a_wildcard_over_a_public_or_shared_suffix_is_refused_naming_it(
    api: httpx.Client, host: str
) -> None:
    reply = api.post(
        "/v1/secrets", json={"name": "OK", "value": VALUE, "hosts": ["a.example", host]}
    )
    assert reply.status_code == 422, reply.text
    assert error_type(reply) == "InvalidRequest" and host in reply.json()["error"]["message"]
    assert VALUE not in reply.text
    assert api.get("/v1/secrets").json() == {"secrets": []}


@pytest.mark.parametrize("name", ["HTTPS_PROXY", "SSL_CERT_FILE", "PATH", "LD_PRELOAD"])
def test_a_name_sandboxes_need_is_refused(api: httpx.Client, name: str) -> None:
    reply = api.post("/v1/secrets", json={"name": name, "value": "v", "hosts": ["a.example"]})
    assert reply.status_code == 400 and error_type(reply) == "InvalidSecret", reply.text
    assert name in reply.json()["error"]["message"]


def test_a_name_in_the_path_that_no_secret_may_have_is_refused(api: httpx.Client) -> None:
    reply = api.get("/v1/secrets/not-a-name")
    assert reply.status_code == 422 and error_type(reply) == "InvalidRequest"


def test_values_are_sealed_at_rest_and_the_keys_files_private(
    server: Server, api: httpx.Client
) -> None:
    assert store(api).status_code == 201
    state = server.state_dir
    for path in state.rglob("*"):
        if path.is_file():
            assert VALUE.encode() not in path.read_bytes(), f"{path} holds the value in the clear"
    kept = b"".join(p.read_bytes() for p in state.glob("vault.db*"))  # with its WAL
    assert b"API_KEY" in kept and b"ciphertext" in kept  # the row is there, sealed
    for private in ("vault.key", "vault-ca.key", "vault.db", "vault.db-wal"):
        assert stat.S_IMODE((state / private).stat().st_mode) == 0o600, private
    assert b"BEGIN CERTIFICATE" in (state / "vault-ca-bundle.pem").read_bytes()


def new_session(api: httpx.Client, body: dict[str, object]) -> httpx.Response:
    return api.post("/v1/sessions", json={"backend": "local", **body})


def run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 60})
    assert reply.status_code == 200, reply.text
    assert reply.json()["error"] is None, reply.json()["error"]
    return str(reply.json()["stdout"])


def test_a_session_sees_only_the_placeholder_and_trusts_the_bundle(api: httpx.Client) -> None:
    assert store(api).status_code == 201
    created = new_session(api, {"network": ["api.example.com"], "secrets": ["API_KEY"]})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    try:
        code = (
            "import os, json, pathlib\n"
            "env = dict(os.environ)\n"
            "bundle = pathlib.Path(env['SSL_CERT_FILE']).read_text()\n"
            "print(json.dumps({'key': env.get('API_KEY'), 'env': env, "
            "'certs': bundle.count('BEGIN CERTIFICATE')}))\n"
        )
        seen = json.loads(run(api, sid, code))
        assert seen["key"] == "cir-secret://API_KEY"
        assert VALUE not in json.dumps(seen["env"])
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
            assert seen["env"][name] == "/run/egress/ca-bundle.pem", name
        assert seen["env"]["NODE_EXTRA_CA_CERTS"] == "/run/egress/egress-ca.pem"
        assert seen["certs"] >= 2  # the system's CAs and the deployment's
        # Nowhere in the sandbox's files or processes either.
        grep = api.post(
            f"/v1/sessions/{sid}/commands",
            json={
                # In halves: the audit log keeps the command.
                "command": f"grep -rIl -- '{VALUE[:8]}''{VALUE[8:]}' /proc/self/environ "
                "/proc/1/environ "
                "/run/egress /workspace /tmp 2>/dev/null; echo done"
            },
        ).json()
        assert grep["stdout"].strip() == "done", grep
        # The session's network policy is its own; the binding only adds substitution.
        assert created.json()["network"]["mode"] == "allow_list"
        assert created.json()["secrets"] == ["API_KEY"]  # names only
        assert api.get(f"/v1/sessions/{sid}").json()["secrets"] == ["API_KEY"]
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_a_session_without_secrets_has_the_trust_files_too(api: httpx.Client) -> None:
    """A sandbox forked or restored from one that had secrets keeps its SSL_CERT_FILE & co.:
    the files they name are in every networked session's egress directory."""
    created = new_session(api, {"network": ["api.example.com"]})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    try:
        code = (
            "import pathlib\n"
            "bundle = pathlib.Path('/run/egress/ca-bundle.pem').read_text()\n"
            "ca = pathlib.Path('/run/egress/egress-ca.pem').read_text()\n"
            "print(bundle.count('BEGIN CERTIFICATE') >= 2, bundle.endswith(ca))\n"
        )
        assert run(api, sid, code).strip() == "True True"
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_a_session_asking_for_what_it_cannot_have_is_refused_before_a_sandbox(
    api: httpx.Client,
) -> None:
    assert store(api).status_code == 201
    unknown = new_session(api, {"network": ["api.example.com"], "secrets": ["NO_SUCH"]})
    assert unknown.status_code == 400, unknown.text
    assert error_type(unknown) == "SecretsNotAvailable" and "NO_SUCH" in unknown.text
    unreached = new_session(api, {"network": ["other.example.com"], "secrets": ["API_KEY"]})
    assert unreached.status_code == 400 and "api.example.com" in unreached.text
    no_network = new_session(api, {"secrets": ["API_KEY"]})
    assert no_network.status_code == 400 and "network" in no_network.json()["error"]["message"]
    malformed = new_session(api, {"network": "any", "secrets": ["bad-name"]})
    assert malformed.status_code == 422
    assert api.get("/v1/sessions").json() == [] or all(
        s.get("state") != "running" for s in api.get("/v1/sessions").json()
    )


def test_the_python_client_stores_lists_gets_and_deletes(server: Server) -> None:
    from code_interpreter_client import APIError, Client
    from tests.orchestrator.service.conftest import KEY_A

    with Client(server.url, KEY_A) as client:
        info = client.store_secret(
            "CLIENT_KEY", VALUE, ["api.example.com"], methods=["GET"], headers=["X-Key"]
        )
        assert (info.name, info.methods, info.headers) == ("CLIENT_KEY", ["GET"], ["x-key"])
        assert [s.name for s in client.list_secrets()] == ["CLIENT_KEY"]
        assert client.get_secret("CLIENT_KEY").hosts == ["api.example.com"]
        client.delete_secret("CLIENT_KEY")
        with pytest.raises(APIError) as missing:
            client.get_secret("CLIENT_KEY")
        assert (missing.value.status, missing.value.kind) == (404, "SecretNotFound")
        with pytest.raises(APIError) as bad:
            client.store_secret("CLIENT_KEY", "bad\nvalue", ["api.example.com"])
        assert bad.value.status == 422 and "bad\nvalue" not in str(bad.value)
