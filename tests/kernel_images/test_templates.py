"""Templates built from a Dockerfile of the operator's own (kernel_images/templates.py), on a
real engine: built FROM a kernel image, labelled, listed, checked that their kernel starts, and
refused, saying why, when they are not built on one of ours or break the kernel."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from docker.errors import ImageNotFound

from kernel_images.templates import (
    TemplateRefused,
    build_template,
    final_base,
    list_templates,
    remove_template,
)
from sandbox.image_labels import KERNEL_IMAGE, LANGUAGES_LABEL, template_image
from tests.conftest import require_backend
from tests.kernel_images.test_images import require_image


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    require_backend("docker")
    client = docker.from_env()
    require_image(client, KERNEL_IMAGE)
    yield client
    client.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def dockerfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return path


def test_a_template_is_built_labelled_listed_and_removed(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    name = unique("analysis")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    built = build_template(
        name,
        dockerfile(
            tmp_path,
            f"FROM {KERNEL_IMAGE}\nUSER root\nCOPY data.csv /opt/data.csv\n"
            "RUN echo from-the-template > /opt/marker.txt\n",
        ),
        tmp_path,
        engine,
    )
    try:
        assert built.image == template_image(name) and built.languages == ("python", "bash")
        labels = engine.images.get(template_image(name)).labels
        assert labels[LANGUAGES_LABEL] == "python,bash"  # its base's, kept
        assert name in [t.name for t in list_templates(engine)]
        marker = engine.containers.run(
            template_image(name), ["cat", "/opt/marker.txt", "/opt/data.csv"], remove=True
        )
        assert marker == b"from-the-template\na,b\n1,2\n"
    finally:
        remove_template(name, engine)
    assert name not in [t.name for t in list_templates(engine)]
    with pytest.raises(TemplateRefused, match="no template"):
        remove_template(name, engine)


def test_a_template_not_built_on_a_kernel_image_is_refused_before_building(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    for text, said in (
        ("FROM debian:bookworm\nRUN true\n", "kernel images"),
        ("FROM code-interpreter-base:bookworm\n", "kernel images"),  # ours, but no kernel
        ("ARG BASE\nFROM ${BASE}\n", "plainly"),
        ("RUN true\n", "no FROM"),
    ):
        with pytest.raises(TemplateRefused, match=said):
            build_template(unique("refused"), dockerfile(tmp_path, text), tmp_path, engine)
    plain = dockerfile(tmp_path, f"FROM {KERNEL_IMAGE}\n")
    for name, said in (
        ("Not A Name", "name"),
        ("x-", "name"),
        ("a" * 64, "name"),
        ("local", "pick"),
        ("snap-1", "pick"),
    ):
        with pytest.raises(TemplateRefused, match=said):
            build_template(name, plain, tmp_path, engine)


def test_a_template_that_changes_the_entrypoint_is_not_kept(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    """The sandbox starts the kernel with the image's own entrypoint in front: one of the
    template's would run instead."""
    name = unique("entry")
    text = f'FROM {KERNEL_IMAGE}\nENTRYPOINT ["/bin/sh", "-c", "echo hijacked"]\n'
    with pytest.raises(TemplateRefused, match="entrypoint"):
        build_template(name, dockerfile(tmp_path, text), tmp_path, engine)
    with pytest.raises(ImageNotFound):
        engine.images.get(template_image(name))


def test_the_last_stage_decides_what_a_template_is_built_on() -> None:
    continued = f"# a comment\nFROM \\\n  {KERNEL_IMAGE}\nRUN echo \\\n  from debian\n"
    assert final_base(continued) == KERNEL_IMAGE
    staged = (
        f"FROM debian:bookworm AS tools\nRUN true\nFROM {KERNEL_IMAGE}\nCOPY --from=tools /x /x\n"
    )
    assert final_base(staged) == KERNEL_IMAGE
    aliased = f"FROM {KERNEL_IMAGE} AS kernel\nFROM kernel\n"
    assert final_base(aliased) == KERNEL_IMAGE


def test_a_template_that_breaks_its_kernel_is_not_kept(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    name = unique("broken")
    text = (
        f"FROM {KERNEL_IMAGE}\nUSER root\n"
        "RUN rm -rf /opt/kernel/lib/python3*/site-packages/ipykernel\n"
    )
    with pytest.raises(TemplateRefused, match="kernel no longer starts"):
        build_template(name, dockerfile(tmp_path, text), tmp_path, engine)
    with pytest.raises(ImageNotFound):
        engine.images.get(template_image(name))


def test_a_failed_build_says_what_failed(engine: docker.DockerClient, tmp_path: Path) -> None:
    text = f"FROM {KERNEL_IMAGE}\nRUN echo the-step-that-fails && exit 3\n"
    with pytest.raises(TemplateRefused, match="the-step-that-fails"):
        build_template(unique("failing"), dockerfile(tmp_path, text), tmp_path, engine)
