"""The `code-interpreter` command."""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from orchestrator.terminal import TerminalPrinter
from sandbox import BackendUnavailable, SandboxError, SandboxSpec, create_backend
from sandbox.spec import ResourceLimits

if TYPE_CHECKING:
    from orchestrator.config import Settings

app = typer.Typer(
    help="A self-hosted, sandboxed, stateful code interpreter for LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)


@app.command()
def run(
    code: Annotated[str | None, typer.Argument(help="Python code to run.")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="Run this script instead.", exists=True)
    ] = None,
    backend: Annotated[str, typer.Option(help="Sandbox backend: local or docker.")] = "local",
    timeout: Annotated[float, typer.Option(help="Time limit of the execution, in seconds.")] = 60,
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Where images are saved.")
    ] = Path("."),
    memory_mb: Annotated[int, typer.Option(help="Memory limit, MiB.")] = 2048,
    image: Annotated[str | None, typer.Option(help="Kernel image (docker).")] = None,
    unsafe_no_sandbox: Annotated[
        bool,
        typer.Option(
            "--unsafe-no-sandbox",
            help="Run with NO isolation (local backend without bubblewrap). Trusted code only.",
        ),
    ] = False,
) -> None:
    """Run code in a fresh sandbox and print what it produced; images are saved as files."""
    if (code is None) == (file is None):
        raise typer.BadParameter("give either CODE or --file, not both and not neither")
    source = file.read_text() if file is not None else code
    assert source is not None
    config: dict[str, object] = {"unsafe_no_sandbox": True} if unsafe_no_sandbox else {}
    spec = SandboxSpec(limits=ResourceLimits(memory_mb=memory_mb), image=image)
    try:
        status = asyncio.run(_run(source, backend, config, spec, timeout, output_dir))
    except (BackendUnavailable, SandboxError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(status)


async def _run(
    source: str,
    backend_name: str,
    config: dict[str, object],
    spec: SandboxSpec,
    time_limit_s: float,
    output_dir: Path,
) -> int:
    backend = create_backend(backend_name, **config)
    try:
        printer = TerminalPrinter(output_dir)
        async with await backend.create(spec) as sandbox:
            execution = await sandbox.execute(
                source, timeout_s=time_limit_s, on_event=printer.on_event
            )
        return printer.finish(execution)
    finally:
        await backend.close()


image_app = typer.Typer(help="Build and list the Docker kernel images.", no_args_is_help=True)
app.add_typer(image_app, name="image")


@image_app.command("build")
def image_build(
    base_image: Annotated[
        str | None,
        typer.Option(
            help="Build on this image (e.g. python:3.11-slim where a registry is reachable) "
            "instead of the debootstrap base."
        ),
    ] = None,
) -> None:
    """Build the base and kernel images; seconds when nothing changed."""
    from kernel_images.build import build_all

    for built in build_all(base_image=base_image):
        state = "up to date" if built.cached else "built"
        typer.echo(f"{built.tag:40} {built.image_id[7:19]}  {state}")


@image_app.command("list")
def image_list() -> None:
    """List the images this project built."""
    from rich.console import Console
    from rich.table import Table

    from kernel_images.build import list_images

    table = Table("image", "role", "id", "size (MB)", "created")
    for column in table.columns:
        column.no_wrap = True
    for row in list_images():
        table.add_row(row["tags"], row["role"], row["id"], row["size_mb"], row["created"])
    Console(width=120).print(table)


def _settings(**overrides: Any) -> Settings:
    from pydantic import ValidationError

    from orchestrator.config import Settings

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        typer.secho(f"error: bad settings: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
) -> None:
    """Serve the HTTP API and MCP at /mcp (settings from CODE_INTERPRETER_* and
    CODE_INTERPRETER_CONFIG)."""
    _serve_http(_settings(), host, port)


class McpTransport(StrEnum):
    STDIO = "stdio"
    STREAMABLE_HTTP = "streamable-http"


@app.command()
def mcp(
    transport: Annotated[
        McpTransport, typer.Option(help="stdio for a desktop client; or streamable-http.")
    ] = McpTransport.STDIO,
    host: Annotated[str | None, typer.Option(help="Address to listen on (HTTP).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (HTTP).")] = None,
) -> None:
    """Serve the code_interpreter tool and the workspace's files over MCP.

    stdio serves the one client that started this process, needing no key; streamable-http
    serves the whole service (MCP at /mcp) with its bearer keys, like `serve`.
    """
    if transport is McpTransport.STDIO:
        from orchestrator.mcp_front.server import serve_stdio

        asyncio.run(serve_stdio(_settings(auth_disabled=True)))
    else:
        _serve_http(_settings(), host, port)


def _serve_http(settings: Settings, host: str | None, port: int | None) -> None:
    import uvicorn

    from orchestrator.app import create_app

    uvicorn.run(
        create_app(settings),
        host=host or settings.host,
        port=port if port is not None else settings.port,
        log_level="info",
        timeout_graceful_shutdown=10,
    )
