"""A template built from a Dockerfile (`code-interpreter template build`) is used by name: by
E2B's unmodified SDK (`Sandbox.create("NAME")`) and by our API (`image`)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

from sandbox.image_labels import KERNEL_IMAGE, template_image
from tests.conftest import require_backend
from tests.orchestrator.service.conftest import Server


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "template", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def built_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_backend("docker")
    name = f"sdk-{uuid.uuid4().hex[:8]}"
    context = tmp_path_factory.mktemp("template")
    (context / "Dockerfile").write_text(
        f"FROM {KERNEL_IMAGE}\nUSER root\nRUN echo made-by-the-template > /opt/marker.txt\n"
    )
    made = cli("build", "--name", name, "-f", str(context / "Dockerfile"), str(context))
    assert made.returncode == 0, made.stderr
    assert template_image(name) in made.stdout and f"Sandbox.create({name!r})" in made.stderr
    yield name
    removed = cli("remove", name)
    assert removed.returncode == 0, removed.stderr


def test_the_e2b_sdk_starts_a_sandbox_from_a_template_by_name(
    e2b_env: Server, built_template: str
) -> None:
    listed = cli("list")
    assert listed.returncode == 0 and built_template in listed.stdout, listed
    sandbox = Sandbox.create(built_template)
    try:
        assert sandbox.run_code("open('/opt/marker.txt').read()").text == "made-by-the-template\\n"
        assert sandbox.commands.run("cat /opt/marker.txt").stdout == "made-by-the-template\n"
    finally:
        sandbox.kill()
    with pytest.raises((NotFoundException, SandboxException), match="not found"):
        Sandbox.create(f"no-such-{built_template}")


def test_our_api_starts_a_session_from_a_template_image(
    e2b_env: Server, built_template: str
) -> None:
    with e2b_env.client() as api:
        made = api.post(
            "/v1/sessions", json={"backend": "docker", "image": template_image(built_template)}
        )
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            done = api.post(
                f"/v1/sessions/{sid}/execute", json={"code": "open('/opt/marker.txt').read()"}
            )
            assert "made-by-the-template" in done.json()["results"][0]["text"], done.text
        finally:
            api.delete(f"/v1/sessions/{sid}")
        missing = api.post(
            "/v1/sessions",
            json={"backend": "docker", "image": template_image(f"none-{built_template}")},
        )
        assert missing.status_code in (400, 503) and "template build" in missing.text, missing.text
        # Only `code-interpreter-template-NAME:latest` names one: no other tag, no registry.
        for other in (
            f"{template_image(built_template)[:-7]}:other",
            f"ghcr.io/x/{template_image(built_template)}",
        ):
            refused = api.post("/v1/sessions", json={"backend": "docker", "image": other})
            assert refused.status_code == 400 and "not allowed" in refused.text, refused.text


def test_the_cli_refuses_a_dockerfile_not_on_a_kernel_image(tmp_path: Path) -> None:
    require_backend("docker")
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm\n")
    refused = cli("build", "--name", "plain", "-f", str(tmp_path / "Dockerfile"), str(tmp_path))
    assert refused.returncode == 2 and "kernel images" in refused.stderr, refused


def test_an_image_named_as_a_template_but_not_built_as_one_is_refused(e2b_env: Server) -> None:
    require_backend("docker")
    engine = docker.from_env()
    name = f"fake-{uuid.uuid4().hex[:8]}"
    engine.images.get(KERNEL_IMAGE).tag(template_image(name)[:-7], tag="latest")
    try:
        with e2b_env.client() as api:
            made = api.post(
                "/v1/sessions", json={"backend": "docker", "image": template_image(name)}
            )
        assert made.status_code >= 400 and "not a template" in made.text, made.text
    finally:
        engine.images.remove(template_image(name))
        engine.close()
