"""What the kernel images hold, checked in containers run as sandboxes run: no network, a
read-only root, a size-capped /tmp, a uid the image does not know, no capabilities, the
project's seccomp policy and the sandboxes' default limits.

Skipped without an engine or the images on a developer's machine; failed in CI (CI=true).
"""

from __future__ import annotations

import base64
import io
import os
import textwrap
from collections.abc import Iterator

import docker
import pytest
from docker.errors import ContainerError, ImageNotFound
from docker.types import Ulimit
from PIL import Image

from code_interpreter_wire.spec import ResourceLimits
from kernel_images.build import (
    FULL_IMAGE_EXTRAS,
    HASH_LABEL,
    KERNEL_IMAGE_EXTRAS,
    extra_requirements,
    full_digest,
    kernel_digest,
)
from sandbox import seccomp
from sandbox.image_labels import (
    DENO_IN_IMAGE,
    FULL_IMAGE,
    FULL_IMAGE_LANGUAGES,
    IMAGE_PATH,
    JAVA_IN_IMAGE,
    JJAVA_JAR_IN_IMAGE,
    KERNEL_IMAGE,
    KERNEL_IMAGE_LANGUAGES,
    LANGUAGES_LABEL,
    R_IN_IMAGE,
    languages_of,
)
from sandbox.install_places import USER_BIN_IN_SANDBOX, USER_BINS_IN_SANDBOX
from sandbox.kernel.command import kernel_environment
from tests.conftest import require_backend

SANDBOX_UID = 231_000  # not in the image's /etc/passwd, as a sandbox's uid is not


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    require_backend("docker")
    client = docker.from_env()
    yield client
    client.close()


def require_image(engine: docker.DockerClient, tag: str) -> None:
    try:
        engine.images.get(tag)
    except ImageNotFound:
        if os.environ.get("CI"):
            pytest.fail(f"the image {tag} must exist in CI: `make image` builds it")
        pytest.skip(f"the image {tag} is missing: run `make image`")


def run_as_sandbox(engine: docker.DockerClient, image: str, command: list[str]) -> str:
    """Run `command` in `image` the way the Docker backend runs a kernel; its stdout, or the
    test fails with its stderr."""
    require_image(engine, image)
    limits = ResourceLimits()
    env = kernel_environment(path=IMAGE_PATH, home="/tmp", limits=limits, extra={})
    memory = f"{limits.memory_mb}m"
    try:
        output: bytes = engine.containers.run(
            image,
            command,
            remove=True,
            user=f"{SANDBOX_UID}:{SANDBOX_UID}",
            environment=env,
            working_dir="/workspace",
            network_mode="none",
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,exec,size={limits.tmp_size_mb}m,mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges", f"seccomp={seccomp.docker_profile()}"],
            pids_limit=limits.pids,
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int(limits.cpus * 1e9),
            ulimits=[Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files)],
            init=True,
            ipc_mode="private",
        )
    except ContainerError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        pytest.fail(f"{command!r} failed in {image} (exit {exc.exit_status}):\n{stderr}")
    return output.decode(errors="replace")


def python(engine: docker.DockerClient, image: str, code: str) -> str:
    return run_as_sandbox(engine, image, ["python", "-c", textwrap.dedent(code)])


@pytest.mark.parametrize(
    ("image", "languages"),
    [(KERNEL_IMAGE, KERNEL_IMAGE_LANGUAGES), (FULL_IMAGE, FULL_IMAGE_LANGUAGES)],
)
def test_each_image_labels_its_languages(
    engine: docker.DockerClient, image: str, languages: tuple[str, ...]
) -> None:
    require_image(engine, image)
    labels = engine.images.get(image).labels
    assert labels[LANGUAGES_LABEL] == ",".join(languages)
    assert languages_of(labels) == languages


def test_the_images_are_what_a_rebuild_would_build(engine: docker.DockerClient) -> None:
    """A rebuild with nothing changed is a look-up: each image's hash label is the hash of
    what it would be built from now (the extras in pyproject.toml, the Dockerfiles...)."""
    require_image(engine, KERNEL_IMAGE)
    require_image(engine, FULL_IMAGE)
    kernel = engine.images.get(KERNEL_IMAGE)
    assert kernel.labels[HASH_LABEL] == kernel_digest(engine), "stale: run `make image`"
    assert engine.images.get(FULL_IMAGE).labels[HASH_LABEL] == full_digest(engine)


@pytest.mark.parametrize(
    ("image", "extras"),
    [(KERNEL_IMAGE, KERNEL_IMAGE_EXTRAS), (FULL_IMAGE, KERNEL_IMAGE_EXTRAS + FULL_IMAGE_EXTRAS)],
)
def test_every_listed_package_is_installed_and_imports(
    engine: docker.DockerClient, image: str, extras: tuple[str, ...]
) -> None:
    """Each distribution of the image's extras is installed, and each of its top-level
    modules imports, in one interpreter as a sandbox's kernel would."""
    names = extra_requirements(*extras)
    out = python(
        engine,
        image,
        f"""
        import importlib, importlib.metadata as md, re
        wanted = {names!r}
        modules = {{}}
        for module, dists in md.packages_distributions().items():
            for dist in dists:
                modules.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), []).append(module)
        for requirement in wanted:
            name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ;\\[]", requirement)[0]).lower()
            md.distribution(name)  # PackageNotFoundError names the missing one
            for module in modules.get(name, []):
                if module.isidentifier() and not module.startswith("_"):
                    importlib.import_module(module)
            print("ok", name)
        """,
    )
    imported = {line.split()[1] for line in out.splitlines() if line.startswith("ok ")}
    assert len(imported) == len(names), out


def test_plotly_renders_a_png_offline(engine: docker.DockerClient) -> None:
    """kaleido drives the image's Chromium: no browser download, no network, non-root."""
    out = python(
        engine,
        KERNEL_IMAGE,
        """
        import base64
        import plotly.graph_objects as go
        import plotly.io as pio
        fig = go.Figure(go.Bar(x=["a", "b", "c"], y=[3, 1, 2]), layout_title_text="offline")
        png = pio.to_image(fig, format="png", width=640, height=480)
        print(base64.b64encode(png).decode())
        """,
    )
    image = Image.open(io.BytesIO(base64.b64decode(out.strip().splitlines()[-1])))
    assert image.format == "PNG"
    assert image.size == (640, 480)
    colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 10, "a blank image: nothing was drawn"


def test_bash_kernel_is_in_the_default_image(engine: docker.DockerClient) -> None:
    out = python(engine, KERNEL_IMAGE, "import bash_kernel.kernel; print('bash kernel ok')")
    assert "bash kernel ok" in out


@pytest.mark.parametrize("image", [KERNEL_IMAGE, FULL_IMAGE])
def test_each_image_has_node_and_npm(engine: docker.DockerClient, image: str) -> None:
    """Agents run `npm install` and `npm i -g` as readily as pip."""
    out = run_as_sandbox(engine, image, ["sh", "-c", "node --version && npm --version"])
    node, npm = out.split()
    assert node.startswith("v") and int(node[1:].split(".")[0]) >= 18, out
    assert int(npm.split(".")[0]) >= 9, out


@pytest.mark.parametrize("image", [KERNEL_IMAGE, FULL_IMAGE])
def test_the_backends_kernel_path_is_each_images_own(
    engine: docker.DockerClient, image: str
) -> None:
    """The PATH the backends give kernels (IMAGE_PATH) is the image's, and a login shell (as
    agent frameworks run commands) rebuilds it the same way: the kernel's Python first, the
    workspace's commands last, and those not for root."""
    require_image(engine, image)
    env = dict(e.split("=", 1) for e in engine.images.get(image).attrs["Config"]["Env"])
    assert env["PATH"] == IMAGE_PATH
    login = run_as_sandbox(engine, image, ["bash", "-lc", "echo $PATH"]).strip().split(":")
    assert login[0] == "/opt/kernel/bin" and tuple(login[-2:]) == USER_BINS_IN_SANDBOX, login
    as_root = engine.containers.run(
        image, ["bash", "-lc", "echo $PATH"], remove=True, user="0", network_mode="none"
    )
    assert USER_BIN_IN_SANDBOX not in as_root.decode(), as_root


def test_full_image_runs_deno_at_its_fixed_path(engine: docker.DockerClient) -> None:
    out = run_as_sandbox(engine, FULL_IMAGE, [DENO_IN_IMAGE, "--version"])
    assert out.startswith("deno 2.")
    assert "typescript" in out


def test_full_image_runs_java_and_holds_jjava(engine: docker.DockerClient) -> None:
    out = run_as_sandbox(
        engine,
        FULL_IMAGE,
        [
            "sh",
            "-c",
            f'{JAVA_IN_IMAGE} -version 2>&1 && test -r "{JJAVA_JAR_IN_IMAGE}" && echo jar',
        ],
    )
    assert "openjdk version" in out
    assert out.strip().endswith("jar")


def test_full_image_runs_r_with_irkernel(engine: docker.DockerClient) -> None:
    version = run_as_sandbox(engine, FULL_IMAGE, [R_IN_IMAGE, "--version"])
    assert version.startswith("R version 4.")
    loaded = run_as_sandbox(
        engine,
        FULL_IMAGE,
        [R_IN_IMAGE, "--slave", "-e", 'library(IRkernel); cat("irkernel", "ok\\n")'],
    )
    assert "irkernel ok" in loaded


def test_full_image_keeps_the_default_images_python_and_bash(engine: docker.DockerClient) -> None:
    out = python(
        engine,
        FULL_IMAGE,
        "import sys, bash_kernel.kernel, pandas; print(sys.executable)",
    )
    assert out.strip() == "/opt/kernel/bin/python"
