"""`code-interpreter volume ...`: a service's volumes (docs/volumes.md), through its HTTP API
with the caller's key, as any client reaches them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from code_interpreter_client.http_client import APIError, Client

volume_app = typer.Typer(
    help="Volumes of a running service: make, list, delete; their files (docs/volumes.md).",
    no_args_is_help=True,
)
DEFAULT_URL = "http://127.0.0.1:8000"
KEY_VARIABLE = "CODE_INTERPRETER_API_KEY"  # where the CLI's calls to a service find their key
UrlOption = Annotated[
    str,
    typer.Option(
        "--url",
        metavar="URL",
        envvar="CODE_INTERPRETER_URL",
        help="The service (or the variable CODE_INTERPRETER_URL).",
    ),
]
KeyEnvOption = Annotated[
    str,
    typer.Option(
        "--api-key-env", metavar="VAR", help="The environment variable holding your API key."
    ),
]
VolumeArgument = Annotated[str, typer.Argument(metavar="VOLUME_ID", help="The volume's id.")]


@contextmanager
def _client(url: str, key_env: str) -> Iterator[Client]:
    """A client of the service; a refusal is printed as the service said it, exit status 1."""
    try:
        with Client(url, os.environ.get(key_env), timeout_s=600) as client:
            yield client
    except APIError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _show(value: object) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


@volume_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="A name of your choosing.")],
    size_mb: Annotated[
        int | None, typer.Option("--size-mb", metavar="MIB", help="Its size; the default if unset.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Make a volume; prints it (its id among its fields)."""
    with _client(url, api_key_env) as client:
        _show(client.create_volume(name, size_mb).model_dump(mode="json"))


@volume_app.command("list")
def list_volumes(url: UrlOption = DEFAULT_URL, api_key_env: KeyEnvOption = KEY_VARIABLE) -> None:
    """Your volumes, oldest first."""
    with _client(url, api_key_env) as client:
        _show([v.model_dump(mode="json") for v in client.list_volumes()])


@volume_app.command("info")
def info(
    volume_id: VolumeArgument,
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """A volume: its size, what it holds, the sessions that mount it."""
    with _client(url, api_key_env) as client:
        _show(client.get_volume(volume_id).model_dump(mode="json"))


@volume_app.command("delete")
def delete(
    volume_id: VolumeArgument,
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Delete a volume and its files (refused while a session mounts it)."""
    with _client(url, api_key_env) as client:
        client.delete_volume(volume_id)


@volume_app.command("ls")
def ls(
    volume_id: VolumeArgument,
    path: Annotated[str, typer.Argument(help="A directory of it; its root if unset.")] = "",
    recursive: Annotated[bool, typer.Option("--recursive", "-r")] = False,
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """A directory of a volume: one entry a line (type, size, path)."""
    with _client(url, api_key_env) as client:
        for entry in client.list_volume_files(volume_id, path, recursive=recursive):
            typer.echo(f"{entry.type}\t{entry.size}\t{entry.path}")


@volume_app.command("put")
def put(
    volume_id: VolumeArgument,
    local: Annotated[Path, typer.Argument(help="The file to upload ('-': standard input).")],
    path: Annotated[str, typer.Argument(help="Where in the volume.")],
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Upload a file into a volume."""
    data = sys.stdin.buffer.read() if str(local) == "-" else local.read_bytes()
    with _client(url, api_key_env) as client:
        _show(client.upload_to_volume(volume_id, path, data).model_dump(mode="json"))


@volume_app.command("get")
def get(
    volume_id: VolumeArgument,
    path: Annotated[str, typer.Argument(help="The file in the volume.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Where to write it; standard output if unset."),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Download a file of a volume."""
    with _client(url, api_key_env) as client:
        data = client.download_from_volume(volume_id, path)
    if output is None:
        sys.stdout.buffer.write(data)
    else:
        output.write_bytes(data)


@volume_app.command("rm")
def rm(
    volume_id: VolumeArgument,
    path: Annotated[str, typer.Argument(help="A file or a directory (with all it holds).")],
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Remove a file or a directory tree of a volume."""
    with _client(url, api_key_env) as client:
        client.delete_from_volume(volume_id, path)


@volume_app.command("mkdir")
def mkdir(
    volume_id: VolumeArgument,
    path: Annotated[str, typer.Argument(help="The directory, with its parents.")],
    url: UrlOption = DEFAULT_URL,
    api_key_env: KeyEnvOption = KEY_VARIABLE,
) -> None:
    """Make a directory in a volume."""
    with _client(url, api_key_env) as client:
        client.make_volume_directory(volume_id, path)
