"""Network policies asked for by the clients people use: E2B's SDK against our E2B front
(`allow_internet_access`, `network`), our own Python client and the OpenAI Agents SDK provider."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from code_interpreter_client.agents_sandbox import (
    CodeInterpreterSandboxClient,
    CodeInterpreterSandboxClientOptions,
)
from code_interpreter_client.code_session import CodeSession
from code_interpreter_wire.network_policy import NetworkPolicy
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.network.conftest import FETCH, Net
from tests.network.upstream import HELLO
from tests.orchestrator.service.conftest import KEY_A, make_server, service_backends


@pytest.fixture(params=service_backends())
def template(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def e2b(monkeypatch: pytest.MonkeyPatch, net: Net) -> Net:
    point_sdk_at(monkeypatch, net.server.url)
    return net


def _fetch(sbx: Sandbox, url: str) -> tuple[int, str]:
    execution = sbx.run_code(FETCH + f"\nprint(json.dumps(fetch({url!r})))")
    assert execution.error is None, execution.error
    status, text = json.loads("".join(execution.logs.stdout))
    return int(status), str(text)


def _detail(net: Net, sandbox_id: str) -> dict[str, object]:
    with httpx.Client(base_url=net.server.url, headers={"X-API-Key": KEY_A}) as api:
        body: dict[str, object] = api.get(f"/sandboxes/{sandbox_id}").json()
        return body


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    yield made
    for sbx in made:
        sbx.kill()


def test_e2b_internet_access_is_the_operators_internet_policy(
    e2b: Net, template: str, sandboxes: list[Sandbox]
) -> None:
    sbx = Sandbox.create(template=template)  # the SDK's default: internet access on
    sandboxes.append(sbx)
    assert _fetch(sbx, f"{e2b.allowed}/hello") == (200, HELLO.decode())
    assert _detail(e2b, sbx.sandbox_id)["allowInternetAccess"] is True
    offline = Sandbox.create(template=template, allow_internet_access=False)
    sandboxes.append(offline)
    assert _fetch(offline, f"{e2b.allowed}/hello")[0] == 0
    assert _detail(e2b, offline.sandbox_id)["allowInternetAccess"] is False


def test_e2b_allow_out_is_an_allow_list(e2b: Net, template: str, sandboxes: list[Sandbox]) -> None:
    """As in E2B: a domain is allowed on the web ports only, an address on every port."""
    sbx = Sandbox.create(
        template=template,
        network={"allow_out": ["127.0.0.1", "allowed.test"], "deny_out": ["0.0.0.0/0"]},
    )
    sandboxes.append(sbx)
    port = e2b.up.port
    assert _fetch(sbx, f"http://127.0.0.1:{port}/hello") == (200, HELLO.decode())
    status, text = _fetch(sbx, f"http://allowed.test:{port}/hello")
    assert status == 403 and "allowed.test:80,443" in text, text
    status, text = _fetch(sbx, f"http://other.test:{port}/hello")
    assert status == 403 and "allow-list" in text, text


def test_e2b_internet_access_where_the_operator_offers_none(
    monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    """The SDKs ask for the internet by default: they get a sandbox, without a network, and its
    detail says so, rather than a refusal of every default request."""
    server = make_server()
    server.start()
    try:
        point_sdk_at(monkeypatch, server.url)
        sbx = Sandbox.create(template=template, allow_internet_access=True)
        try:
            assert sbx.run_code("import os; os.environ.get('HTTP_PROXY')").text is None
            with httpx.Client(base_url=server.url, headers={"X-API-Key": KEY_A}) as api:
                assert (
                    api.get(f"/sandboxes/{sbx.sandbox_id}").json()["allowInternetAccess"] is False
                )
        finally:
            sbx.kill()
        with pytest.raises(Exception, match="no network access"):
            Sandbox.create(
                template=template,
                network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]},
            )
    finally:
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def test_our_client_asks_for_a_policy(net: Net) -> None:
    with CodeSession.remote(net.server.url, KEY_A, network=[f"allowed.test:{net.up.port}"]) as code:
        code.execute_sync(FETCH)
        out = code.execute_sync(f"print(json.dumps(fetch('{net.allowed}/hello')))")
        assert json.loads(out.stdout) == [200, HELLO.decode()]
        sid = code.session_id
        assert sid is not None
        with net.server.client() as api:
            report = api.get(f"/v1/sessions/{sid}/network").json()
        assert report["policy"]["allow"][0]["host"] == "allowed.test"
        assert report["connections_allowed"] == 1


async def test_the_agents_sdk_provider_asks_for_a_policy(net: Net) -> None:
    client = CodeInterpreterSandboxClient(base_url=net.server.url, api_key=KEY_A)
    try:
        policy = NetworkPolicy.model_validate([f"allowed.test:{net.up.port}"])
        options = CodeInterpreterSandboxClientOptions(network=policy)
        session = await client.create(options=options)
        async with session:
            result = await session.exec(f"curl -sS {net.allowed}/hello")
            assert result.exit_code == 0 and result.stdout.decode() == HELLO.decode()
            refused = await session.exec(
                f"curl -sS -o /dev/null -w '%{{http_code}}' http://other.test:{net.up.port}/"
            )
            assert refused.stdout.decode() == "403"
    finally:
        await client.close()
