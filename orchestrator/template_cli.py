"""`code-interpreter template ...`: build, list and remove templates (kernel_images/templates.py),
the kernel images operators make from a Dockerfile of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

template_app = typer.Typer(
    help="Build, list and remove templates: kernel images from a Dockerfile of your own.",
    no_args_is_help=True,
)


@template_app.command("build")
def template_build(
    name: Annotated[str, typer.Option("--name", help="Its name: what a session asks for.")],
    dockerfile: Annotated[
        Path,
        typer.Option(
            "-f",
            "--file",
            help="The Dockerfile: FROM code-interpreter-kernel:latest, "
            "code-interpreter-kernel-full:latest or another template.",
        ),
    ] = Path("Dockerfile"),
    context: Annotated[Path, typer.Argument(help="The build context (files COPY reads).")] = Path(
        "."
    ),
) -> None:
    """Build a template (replacing one of that name) and check its kernel starts."""
    from docker.errors import DockerException

    from kernel_images.templates import TemplateRefused, build_template

    try:
        built = build_template(name, dockerfile, context)
    except (TemplateRefused, DockerException) as exc:
        typer.secho(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{built.image}  {built.image_id[7:19]}  languages: {', '.join(built.languages)}")
    typer.secho(
        f"E2B's SDK: Sandbox.create({built.name!r}); our API: a session with "
        f'"image": "{built.image}"',
        err=True,
    )


@template_app.command("list")
def template_list() -> None:
    """The templates on this engine."""
    from docker.errors import DockerException

    from kernel_images.templates import list_templates

    try:
        found = list_templates()
    except DockerException as exc:
        typer.secho(f"error: no Docker engine: {exc}", err=True)
        raise typer.Exit(2) from None
    if not found:
        typer.echo("no templates yet: code-interpreter template build -f Dockerfile --name NAME")
        return
    for template in found:
        typer.echo(
            f"{template.name:24} {template.image_id[7:19]}  {template.created}  "
            f"{', '.join(template.languages)}"
        )


@template_app.command("remove")
def template_remove(name: Annotated[str, typer.Argument(help="The template's name.")]) -> None:
    """Remove a template (sessions running from it keep it until they end)."""
    from docker.errors import DockerException

    from kernel_images.templates import TemplateRefused, remove_template

    try:
        remove_template(name)
    except (TemplateRefused, DockerException) as exc:
        typer.secho(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"template {name!r} removed")
