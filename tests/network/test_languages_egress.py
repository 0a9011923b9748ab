"""Every language's kernel reaches an allowed host through the same proxy, by the variables the
sandbox sets (HTTP_PROXY for Deno, R and curl; Java's proxy properties)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.network.conftest import Net
from tests.network.upstream import HELLO
from tests.orchestrator.service.conftest import service_backends

CODE = {
    "bash": "curl -sS {url}",
    "javascript": "const r = await fetch('{url}'); console.log(await r.text());",
    "r": "cat(readLines(url('{url}'), warn = FALSE))",
    "java": (
        'var s = new java.net.URI("{url}").toURL().openStream();'
        "System.out.print(new String(s.readAllBytes()));"
    ),
}


@pytest.fixture(params=service_backends())
def session(request: pytest.FixtureRequest, net: Net) -> Iterator[tuple[httpx.Client, str]]:
    body = {"backend": request.param, "network": [f"allowed.test:{net.up.port}"]}
    if request.param == "docker":
        body["image"] = "code-interpreter-kernel-full:latest"
    with net.server.client() as api:
        created = api.post("/v1/sessions", json=body)
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        yield api, sid
        api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("language", list(CODE))
def test_each_language_reaches_an_allowed_host(
    net: Net, session: tuple[httpx.Client, str], language: str
) -> None:
    api, sid = session
    languages = api.get(f"/v1/sessions/{sid}").json()["languages"]
    if language not in languages:
        if os.environ.get("CI"):  # CI installs every language
            pytest.fail(f"{language} must be installed in CI")
        pytest.skip(f"{language} is not installed here")
    code = CODE[language].format(url=f"{net.allowed}/hello")
    reply = api.post(
        f"/v1/sessions/{sid}/execute", json={"code": code, "language": language, "timeout_s": 120}
    ).json()
    assert reply["error"] is None, reply["error"]
    assert reply["stdout"].strip() == HELLO.decode(), reply
