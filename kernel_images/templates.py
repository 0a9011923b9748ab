"""Templates: kernel images an operator builds from a Dockerfile of their own (packages, files,
tools), as E2B's users build theirs; a session, or E2B's `Sandbox.create("NAME")`, then starts
from one by name.

A template is built FROM one of this project's kernel images (or another template): the kernel,
its start-up and the command server are there, and a sandbox confines it as it confines the
image it came from. It is built untagged, with the host's network (as `image build` is, so `RUN
pip install` or `apt-get` reach what the host reaches), then checked, and only then named
`code-interpreter-template-NAME:latest`: its layers must start with its base's, its entrypoint
and volumes must be its base's (the launcher relies on both), and its kernel's Python must still
import the kernel, run as a sandbox runs (no network, no capabilities, read-only, its own uid).
A check that fails leaves the template of that name as it was.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import APIError, BuildError, DockerException, ImageNotFound
from docker.models.images import Image

from kernel_images.build import ROLE_LABEL
from sandbox.backends.registry import BACKENDS
from sandbox.image_labels import (
    KERNEL_VENV_IN_IMAGE,
    LANGUAGES_LABEL,
    TEMPLATE_LABEL,
    TEMPLATE_NAME,
    languages_of,
    named_template,
    template_image,
)

MAX_NAME = 63
# Names that already mean something to E2B's SDK here (its default templates, our backends).
RESERVED = frozenset({"base", "code-interpreter", "code-interpreter-v1", *BACKENDS})
# The images a template may be built on: the kernel images, and templates.
BASES = ("kernel", "full", "template")
_FROM = re.compile(r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.IGNORECASE)
CHECK = (f"{KERNEL_VENV_IN_IMAGE}/bin/python", "-c", "import ipykernel.kernelapp")
CHECK_TIMEOUT_S = 120
_CHECK_UID = "231000:231000"  # not in the image's /etc/passwd, as a sandbox's uid is not


class TemplateRefused(Exception):
    """A template that cannot be built, used or removed, and why."""


@dataclass(frozen=True)
class Template:
    """A template on the engine: what `template list` shows."""

    name: str
    image: str
    image_id: str
    languages: tuple[str, ...]
    created: str


def check_name(name: str) -> None:
    """Refuse a name Docker's image names cannot hold, or one E2B's SDK already means."""
    if len(name) > MAX_NAME or not TEMPLATE_NAME.fullmatch(name):
        raise TemplateRefused(
            f"a template's name is up to {MAX_NAME} lower-case letters and digits, joined by "
            f"'-', '_', '__' or '.': {name!r} is not one"
        )
    if name in RESERVED or name.startswith("snap-"):  # snap-...: a snapshot's id to E2B's SDK
        raise TemplateRefused(f"{name!r} already names a template or backend here: pick another")


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, each on one line: comments dropped, continued lines
    (a trailing backslash) joined."""
    out: list[str] = []
    pending = ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def final_base(dockerfile: str) -> str:
    """The image the Dockerfile's last stage is built on, through stages it names by alias."""
    stages: dict[str, str] = {}
    last = None
    for line in _instructions(dockerfile):
        found = _FROM.match(line)
        if found is None:
            continue
        image, alias = found.group(1), found.group(2)
        if "$" in image:
            raise TemplateRefused(
                f"FROM {image}: name the image a template is built on plainly, not by an ARG"
            )
        last = stages.get(image.lower(), image)
        if alias:
            stages[alias.lower()] = last
    if last is None:
        raise TemplateRefused("the Dockerfile has no FROM line")
    return last


def _base_image(client: docker.DockerClient, base: str) -> Image:
    try:
        image = client.images.get(base)
    except DockerException:  # not on the engine (ImageNotFound), or no engine
        image = None
    if image is None or (image.labels or {}).get(ROLE_LABEL) not in BASES:
        raise TemplateRefused(
            f"FROM {base}: a template is built on one of this service's kernel images "
            "(code-interpreter-kernel:latest, code-interpreter-kernel-full:latest) or on another "
            "template, which hold the kernel and what confines it; build those with "
            "`code-interpreter image build`"
        )
    return image


def _config(image: Image, key: str) -> Any:
    return (image.attrs.get("Config") or {}).get(key)


def _check_built(client: docker.DockerClient, built: Image, base: Image) -> None:
    """Refuse what was built unless a sandbox can run it as it runs its base."""
    layers = (built.attrs.get("RootFS") or {}).get("Layers") or []
    base_layers = (base.attrs.get("RootFS") or {}).get("Layers") or []
    if layers[: len(base_layers)] != base_layers:
        raise TemplateRefused("the built image is not built on the image its last FROM names")
    for key in ("Entrypoint", "Volumes"):
        if _config(built, key) != _config(base, key):
            raise TemplateRefused(
                f"the Dockerfile changes the image's {key.lower()} ({_config(built, key)!r}): "
                "the sandbox starts the kernel itself and keeps no volumes; leave it as the base's"
            )
    container = client.containers.create(
        built.id,
        list(CHECK),
        user=_CHECK_UID,
        network_mode="none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        read_only=True,
        tmpfs={"/tmp": "size=64m"},
        mem_limit="512m",
        pids_limit=128,
    )
    try:
        container.start()
        status = container.wait(timeout=CHECK_TIMEOUT_S)
        if status.get("StatusCode") != 0:
            said = container.logs(stdout=False, stderr=True)[-1000:].decode(errors="replace")
            raise TemplateRefused(
                f"its kernel no longer starts ({' '.join(CHECK)} failed, as the sandbox's "
                f"user): {said.strip()}"
            )
    except (DockerException, requests.RequestException) as exc:  # timed out, or the engine
        raise TemplateRefused(f"its kernel could not be checked: {exc}") from None
    finally:
        with contextlib.suppress(DockerException):
            container.remove(force=True)


def build_template(
    name: str, dockerfile: Path, context: Path, client: docker.DockerClient | None = None
) -> Template:
    """Build the template `name` from `dockerfile` (its context: `context`), check it, and
    keep it under its name (replacing one of that name only once the check passed)."""
    check_name(name)
    if not dockerfile.is_file():
        raise TemplateRefused(f"no Dockerfile at {dockerfile}")
    if not context.is_dir():
        raise TemplateRefused(f"the build context {context} is not a directory")
    client = client or docker.from_env()
    base = _base_image(client, final_base(dockerfile.read_text()))
    try:
        built, _ = client.images.build(
            path=str(context),
            dockerfile=str(dockerfile.resolve()),
            rm=True,
            forcerm=True,
            network_mode="host",
            # Its base's languages, whatever a LABEL line of the Dockerfile says.
            labels={
                ROLE_LABEL: "template",
                TEMPLATE_LABEL: name,
                LANGUAGES_LABEL: (base.labels or {}).get(LANGUAGES_LABEL, "python"),
            },
        )
    except BuildError as exc:
        lines = [str(part.get("stream", "")).rstrip() for part in exc.build_log]
        tail = "\n".join(line for line in lines if line)[-2000:]
        raise TemplateRefused(f"the template's build failed: {exc.msg}\n{tail}") from None
    try:
        _check_built(client, built, base)
        built.tag(template_image(name).removesuffix(":latest"), tag="latest")
    except (TemplateRefused, DockerException) as refused:
        with contextlib.suppress(DockerException):
            client.images.remove(built.id, force=True)
        raise TemplateRefused(f"{refused}; the template was not kept") from None
    return _template(client.images.get(template_image(name)))


def _template(image: Image) -> Template:
    labels = image.labels or {}
    name = labels.get(TEMPLATE_LABEL, "")
    return Template(
        name=name,
        image=template_image(name),
        image_id=str(image.id),
        languages=languages_of(labels),
        created=str(image.attrs.get("Created", ""))[:19],
    )


def list_templates(client: docker.DockerClient | None = None) -> list[Template]:
    """The templates on the engine: the images their names tag (one built FROM a template
    inherits its label, and is not it)."""
    client = client or docker.from_env()
    found = client.images.list(filters={"label": TEMPLATE_LABEL, "dangling": False})
    named = [image for image in found if named_template(image.labels, image.tags)]
    return sorted((_template(image) for image in named), key=lambda t: t.name)


def remove_template(name: str, client: docker.DockerClient | None = None) -> None:
    """Remove the template's name; its image goes once nothing uses it (a running sandbox
    keeps it, as does a template built on it)."""
    check_name(name)
    client = client or docker.from_env()
    try:
        client.images.remove(template_image(name), force=True)
    except ImageNotFound:
        raise TemplateRefused(f"there is no template {name!r} (see `template list`)") from None
    except APIError as exc:  # a template built on it holds its only name
        raise TemplateRefused(f"template {name!r} cannot be removed: {exc.explanation}") from None
