"""The `code-interpreter` command."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from code_interpreter_wire.errors import BackendUnavailable, SandboxError
from code_interpreter_wire.languages import LANGUAGES, canonical_language, language_for_suffix
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from orchestrator import release
from orchestrator.governance.audit_cli import audit_app
from orchestrator.governance.keys_cli import keys_app
from orchestrator.http_errors import problems
from orchestrator.template_cli import template_app
from orchestrator.terminal import TerminalPrinter
from orchestrator.volume_cli import KEY_VARIABLE as DEFAULT_KEY_VARIABLE
from orchestrator.volume_cli import volume_app
from orchestrator.wasm_cli import wasm_app
from sandbox.backends.registry import BACKENDS

if TYPE_CHECKING:
    from code_interpreter_client.code_session import CodeSession
    from code_interpreter_wire.processes import CommandResult, ProcessOutput
    from orchestrator.config import Settings

BACKEND_NAMES = f"{', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}"
EXIT_USAGE = 2  # bad usage, a backend that cannot run, a file that could not be copied
EXIT_TIMEOUT = 124  # as timeout(1)
EXIT_NO_STATUS = 125  # a command that ended without an exit status or a signal
AnyPath = TypeVar("AnyPath", Path, PurePosixPath)

# Plain help (no rich markup): rich's help shows a `<bool>` or `<str>` beside every option.
app = typer.Typer(
    help="A self-hosted, sandboxed, stateful code interpreter for LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"code-interpreter {release.version()}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(EXIT_USAGE)


# Options `run` and `exec` share, for the sandbox of this process they start.
ImageOption = Annotated[str | None, typer.Option(metavar="IMAGE", help="Kernel image (docker).")]
UnsafeNoSandboxOption = Annotated[
    bool,
    typer.Option(
        "--unsafe-no-sandbox",
        help="Run with NO isolation (local backend without bubblewrap). Trusted code only.",
    ),
]


def _sandbox_spec(memory_mb: int, image: str | None) -> SandboxSpec:
    """The spec of the sandbox `run` or `exec` starts; a bad limit is a usage error."""
    try:
        return SandboxSpec(limits=ResourceLimits(memory_mb=memory_mb), image=image)
    except ValidationError as exc:
        raise typer.BadParameter(problems(exc.errors()), param_hint="--memory-mb") from None


@app.command()
def run(
    code: Annotated[str | None, typer.Argument(metavar="CODE", hidden=True)] = None,
    script: Annotated[
        str | None,
        typer.Option(
            "--script",
            "-f",
            metavar="PATH",
            help="Run this script instead of CODE; - reads it from stdin. Its suffix names its "
            "language (.R, .sh, .js, .ts, .java) unless --language does.",
        ),
    ] = None,
    language: Annotated[
        str | None,
        typer.Option(
            "--language",
            "-l",
            metavar="NAME",
            help=f"The language of the code: {', '.join(LANGUAGES)} (or js, ts, sh).  "
            "[default: the script's suffix's, else python]",
        ),
    ] = None,
    files: Annotated[
        list[Path] | None,
        typer.Option(
            "--file",
            metavar="PATH",
            help="Copy this local file into the workspace before the run, under its own name, "
            "so the code can open it. Repeatable.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    downloads: Annotated[
        list[str] | None,
        typer.Option(
            "--download",
            metavar="PATH",
            help="After the run, copy this file of the workspace (e.g. results/table.csv) into "
            "--output-dir, under its own name. Repeatable.",
        ),
    ] = None,
    backend: Annotated[
        str, typer.Option(metavar="NAME", help=f"Sandbox backend: {BACKEND_NAMES}.")
    ] = "local",
    timeout: Annotated[
        float, typer.Option(metavar="SECONDS", help="Time limit of the execution.")
    ] = 60,
    output_dir: Annotated[
        Path,
        typer.Option(
            "--output-dir", "-o", metavar="DIR", help="Where images and --download files go."
        ),
    ] = Path("."),
    memory_mb: Annotated[int, typer.Option(metavar="MIB", help="Memory limit, MiB.")] = 2048,
    image: ImageOption = None,
    unsafe_no_sandbox: UnsafeNoSandboxOption = False,
) -> None:
    """Run CODE (Python, or the --language given) in a fresh sandbox and print what it
    produced.

    stdout goes to stdout, everything else to stderr; images are saved in --output-dir. Exit
    codes: 0 ok, 1 the code raised, 124 timed out, 125 the kernel died, 2 bad usage or a
    backend, upload or download that failed.
    """
    source = _source(code, script)
    kernel = _language(language, script)
    uploads = _unique_names(files or [], "--file")
    wanted = _unique_names([PurePosixPath(p) for p in downloads or []], "--download")
    config: dict[str, object] = {"unsafe_no_sandbox": True} if unsafe_no_sandbox else {}
    spec = _sandbox_spec(memory_mb, image)
    printer = TerminalPrinter(output_dir)
    from orchestrator.sessions import SessionError  # what the service refuses, e.g. a limit

    try:
        status = asyncio.run(
            _run(source, kernel, backend, config, spec, timeout, uploads, wanted, printer)
        )
    except (BackendUnavailable, SandboxError, SessionError, ValueError) as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(status)


def _source(code: str | None, script: str | None) -> str:
    if (code is None) == (script is None):
        raise typer.BadParameter("give either CODE or --script (-f), not both and not neither")
    if script is None:
        assert code is not None
        return code
    if script == "-":
        return sys.stdin.read()
    try:
        return Path(script).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read the script {script}: {exc}") from None


def _language(language: str | None, script: str | None) -> str:
    """The language to run: the one given, else the script's suffix's, else Python. A name
    that is no language is a usage error naming those there are."""
    if language is not None:
        try:
            return canonical_language(language)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--language") from None
    by_suffix = language_for_suffix(Path(script).suffix) if script not in (None, "-") else None
    return by_suffix or canonical_language(None)


def _unique_names(paths: list[AnyPath], option: str) -> list[AnyPath]:
    """Files land under their own names, so two with one name would overwrite each other."""
    seen: dict[str, AnyPath] = {}
    for path in paths:
        if path.name in seen:
            raise typer.BadParameter(
                f"{seen[path.name]} and {path} would both be {path.name!r}", param_hint=option
            )
        seen[path.name] = path
    return paths


async def _run(
    source: str,
    language: str,
    backend_name: str,
    config: dict[str, object],
    spec: SandboxSpec,
    time_limit_s: float,
    uploads: list[Path],
    downloads: list[PurePosixPath],
    printer: TerminalPrinter,
) -> int:
    from code_interpreter_client.code_session import CodeSession

    async with CodeSession.embedded(backend_name, spec, **config) as session:
        for path in uploads:
            await session.upload(path.name, path.read_bytes())
        execution = await session.execute(
            source, timeout_s=time_limit_s, on_event=printer.on_event, language=language
        )
        status = printer.finish(execution)
        all_copied = await _download(session, downloads, printer)
    return EXIT_USAGE if status == 0 and not all_copied else status


async def _download(
    session: CodeSession, paths: list[PurePosixPath], printer: TerminalPrinter
) -> bool:
    """Copy workspace files out; each one missing is named. Whether all were copied."""
    all_copied = True
    for path in paths:
        try:
            data = await session.download(str(path))
        except SandboxError as exc:
            printer.error(f"cannot download {str(path)!r}: {exc}")
            all_copied = False
        else:
            printer.save(path.name, data)
    return all_copied


@app.command(
    "exec",
    # What follows the command's name is its own: `exec ls -la` passes -la to ls.
    context_settings={"allow_interspersed_args": False},
)
def exec_command(
    argv: Annotated[
        list[str] | None,
        typer.Argument(metavar="CMD", hidden=True),  # told in the text: no type placeholder
    ] = None,
    files: Annotated[
        list[Path] | None,
        typer.Option(
            "--file",
            metavar="PATH",
            help="Copy this local file into the workspace before the command, under its own "
            "name. Repeatable.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    downloads: Annotated[
        list[str] | None,
        typer.Option(
            "--download",
            metavar="PATH",
            help="After the command, copy this file of the workspace into --output-dir, under "
            "its own name. Repeatable.",
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(metavar="NAME", help=f"Sandbox backend: {BACKEND_NAMES}.  [default: local]"),
    ] = None,
    timeout: Annotated[
        float, typer.Option(metavar="SECONDS", help="Time limit of the command.")
    ] = 60,
    output_dir: Annotated[
        Path,
        typer.Option("--output-dir", "-o", metavar="DIR", help="Where --download files go."),
    ] = Path("."),
    memory_mb: Annotated[
        int | None, typer.Option(metavar="MIB", help="Memory limit, MiB.  [default: 2048]")
    ] = None,
    image: ImageOption = None,
    unsafe_no_sandbox: UnsafeNoSandboxOption = False,
    url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="Run in a session of the code-interpreter service at URL instead of a fresh "
            "sandbox of this process: the one --session-id names, else a new one ended after.",
        ),
    ] = None,
    session_id: Annotated[
        str | None,
        typer.Option(
            "--session-id", metavar="ID", help="The service's session to run in (with --url)."
        ),
    ] = None,
    api_key_env: Annotated[
        str,
        typer.Option(
            "--api-key-env",
            metavar="VAR",
            help="The environment variable holding the service's API key (with --url).",
        ),
    ] = DEFAULT_KEY_VARIABLE,
) -> None:
    """Run CMD (a command and its arguments) in a sandbox, beside its Python kernel, and print
    its output as it comes.

    Example: code-interpreter exec -- python3 -c 'import pandas; print(pandas.__version__)'

    CMD is run as it is: no shell reads it unless you run one (sh -c '...'). It runs in a
    fresh sandbox (the workspace is its working directory), or with --url in a session of a
    running service. Its stdout goes to stdout and its stderr to stderr. Exit codes: the
    command's own; 124 it ran past --timeout and was killed; 128+N a signal N ended it; 2 bad
    usage or a backend, service, upload or download that failed.
    """
    if not argv:
        raise typer.BadParameter("give CMD, the command to run, e.g. exec -- ls -la")
    if session_id is not None and url is None:
        raise typer.BadParameter("--session-id needs --url: the service that holds the session")
    if url is not None:
        local_only = {"--backend": backend, "--memory-mb": memory_mb, "--image": image}
        given = [name for name, value in local_only.items() if value is not None]
        if unsafe_no_sandbox:
            given.append("--unsafe-no-sandbox")
        if given:
            raise typer.BadParameter(
                f"{', '.join(given)} set a sandbox of this process; with --url the service's "
                "session is used as it is"
            )
    uploads = _unique_names(files or [], "--file")
    wanted = _unique_names([PurePosixPath(p) for p in downloads or []], "--download")
    from code_interpreter_client.code_session import CodeSession

    session: CodeSession
    if url is not None:
        session = CodeSession.remote(url, os.environ.get(api_key_env), session_id)
    else:
        config: dict[str, object] = {"unsafe_no_sandbox": True} if unsafe_no_sandbox else {}
        spec = _sandbox_spec(memory_mb if memory_mb is not None else 2048, image)
        session = CodeSession.embedded(backend or "local", spec, **config)
    printer = TerminalPrinter(output_dir)
    from code_interpreter_client.http_client import APIError
    from orchestrator.sessions import SessionError

    try:
        status = asyncio.run(_exec(session, argv, timeout, uploads, wanted, printer))
    except (BackendUnavailable, SandboxError, SessionError, APIError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:  # e.g. the service cannot be reached
        raise _fail(f"{url or 'the sandbox'}: {exc}") from None
    raise typer.Exit(status)


async def _exec(
    session: CodeSession,
    argv: list[str],
    time_limit_s: float,
    uploads: list[Path],
    downloads: list[PurePosixPath],
    printer: TerminalPrinter,
) -> int:
    from code_interpreter_wire.processes import ProcessRequest

    async with session:
        for path in uploads:
            await session.upload(path.name, path.read_bytes())
        request = ProcessRequest(argv=argv, timeout_s=time_limit_s)
        result = await session.run_command(request, on_output=_print_output)
        status = _exit_status(result, printer)
        all_copied = await _download(session, downloads, printer)
    return EXIT_USAGE if status == 0 and not all_copied else status


async def _print_output(output: ProcessOutput) -> None:
    """Each chunk as it comes, as the bytes it is: stderr to stderr, the rest to stdout."""
    stream = sys.stderr if output.stream == "stderr" else sys.stdout
    stream.buffer.write(output.data)
    stream.buffer.flush()


def _exit_status(result: CommandResult, printer: TerminalPrinter) -> int:
    """The exit code that says how the command ended; how, said on stderr when not by itself."""
    if result.timed_out:
        printer.error(f"the command was {result.error or 'killed after its time limit'}")
        return EXIT_TIMEOUT
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None:
        printer.error(f"the command was ended by signal {result.signal}")
        return 128 + result.signal
    printer.error(f"the command ended without an exit status: {result.error or 'unknown'}")
    return EXIT_NO_STATUS


image_app = typer.Typer(help="Build and list the Docker kernel images.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(audit_app, name="audit")
app.add_typer(keys_app, name="keys")
app.add_typer(template_app, name="template")
app.add_typer(wasm_app, name="wasm")
app.add_typer(volume_app, name="volume")


@image_app.command("build")
def image_build(
    base_image: Annotated[
        str | None,
        typer.Option(
            metavar="IMAGE",
            help="Build on this image (e.g. python:3.11-slim where a registry is reachable) "
            "instead of the debootstrap base.",
        ),
    ] = None,
) -> None:
    """Build the base, the default kernel image and the full one (every language); seconds when
    nothing changed."""
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
    """The service's settings; what is wrong with them is said one line each, by the name the
    user sets (the environment variable), never as pydantic's report."""

    from orchestrator.config import Settings

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        for error in exc.errors():
            message = error["msg"].removeprefix("Value error, ")
            if error["loc"]:
                field, *inner = (str(part) for part in error["loc"])
                where = f"CODE_INTERPRETER_{field.upper()}" + "".join(f"[{p}]" for p in inner)
                message = f"bad setting {where}: {message}"
            typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def serve(
    host: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS",
            help="Address to listen on; otherwise the setting CODE_INTERPRETER_HOST.  "
            "[default: 127.0.0.1]",
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            metavar="PORT",
            help="Port to listen on; otherwise the setting CODE_INTERPRETER_PORT.  [default: 8000]",
        ),
    ] = None,
    backends: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            metavar="NAME",
            help="A backend sessions may use (repeatable; the first is the default): "
            f"{BACKEND_NAMES} (ray: cluster mode). Otherwise the backends setting.",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            metavar="HOST:PORT",
            help="The Ray cluster of the ray backend (makes ray the default and, unless "
            "--backend says more, the only backend).",
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            metavar="URL",
            help="The shared session store of cluster mode: redis://HOST:PORT/DB. Every "
            "replica behind one URL uses the same.",
        ),
    ] = None,
) -> None:
    """Serve the HTTP API, and MCP at /mcp.

    Settings come from CODE_INTERPRETER_* environment variables and, optionally, a TOML file
    named by CODE_INTERPRETER_CONFIG (the environment wins).

    Keys: clients send "Authorization: Bearer KEY", with KEY one of
    CODE_INTERPRETER_API_KEYS=key-one,key-two (the api_keys setting). Without keys, set
    CODE_INTERPRETER_AUTH_DISABLED=true (auth_disabled): for one user on a trusted machine
    only, since anyone who reaches the port can then run code.

    Cluster mode (docs/cluster.md): serve --backend ray --ray-address HOST:PORT --store
    redis://HOST:PORT/DB, on each replica.
    """
    _serve_http(_settings(**_cluster_overrides(backends, ray_address, store)), host, port)


def _cluster_overrides(
    backends: list[str] | None, ray_address: str | None, store: str | None
) -> dict[str, object]:
    """The settings `serve`'s options set; --ray-address alone means `--backend ray`."""
    overrides: dict[str, object] = {}
    if not backends and ray_address is not None:
        backends = ["ray"]
    if backends:
        overrides |= {"backends": list(dict.fromkeys(backends)), "default_backend": backends[0]}
    if ray_address is not None:
        overrides["ray_address"] = ray_address
    if store is not None:
        overrides["store_url"] = store
    return overrides


class McpTransport(StrEnum):
    STDIO = "stdio"
    STREAMABLE_HTTP = "streamable-http"


@app.command()
def mcp(
    transport: Annotated[
        McpTransport,
        typer.Option(metavar="TRANSPORT", help="stdio (for a desktop client) or streamable-http."),
    ] = McpTransport.STDIO,
    host: Annotated[
        str | None, typer.Option(metavar="ADDRESS", help="Address to listen on (HTTP).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(metavar="PORT", help="Port to listen on (HTTP).")
    ] = None,
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
    from orchestrator.app import create_app
    from orchestrator.http_server import listening_socket, serve

    # The service's own address is one its sandboxes' egress proxies refuse (docs/network.md):
    # the socket is bound first (port 0: any free one), so that the settings say where it
    # listens, options included, and nothing can take the port in between.
    host = host or settings.host
    port = port if port is not None else settings.port
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        message = f"error: cannot listen on {host} port {port}: {exc}"
        typer.secho(message, fg=typer.colors.RED, err=True)
        raise typer.Exit(EXIT_USAGE) from None
    settings = settings.model_copy(update={"host": host, "port": sock.getsockname()[1]})
    serve(create_app(settings), settings, sock)
