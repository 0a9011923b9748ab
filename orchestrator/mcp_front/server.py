"""The code interpreter as an MCP server: `code_interpreter`, plus the workspace's files, and
`run_command` (shell commands in the same session) when the operator turned it on.

Each MCP connection gets one session of ours, made on its first call, so state persists across
calls without the model passing ids: over stdio the connection is the process; over streamable
HTTP it is the `Mcp-Session-Id` of protocol versions with a handshake. The 2026-07-28 protocol
has no connections (every request stands alone), so there each result names its session_id and
the model passes it back to continue; any client may do the same to reach a session explicitly.

While a `code_interpreter` or `run_command` call runs, a request of its session for a human's
approval (a risky host tool, or a key whose policy gates executions or commands) is also asked
of the client's user by MCP elicitation: accepted, the answer decides it; declined or cancelled,
it is a denial. A client without elicitation (or a connectionless one, which the server cannot
ask) leaves it to the other ways of answering: the API, the webhook, the console.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import logging
import mimetypes
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    ClientCapabilities,
    ElicitationCapability,
    EmbeddedResource,
    ImageContent,
    TextContent,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field

from code_interpreter_wire.errors import FileTooLarge, SandboxError, UnknownLanguage
from code_interpreter_wire.languages import canonical_language
from code_interpreter_wire.tool_arguments import SHELL_TOOL_NAME, TOOL_NAME, ShellToolArguments
from code_interpreter_wire.tool_definitions import (
    LIBRARIES,
    ToolFormat,
    description,
    shell_description,
)
from code_interpreter_wire.tool_output import MAX_INLINE_IMAGE_BYTES, format_output
from orchestrator import release
from orchestrator.auth import LOCAL_OWNER
from orchestrator.config import Settings
from orchestrator.governance.approvals import MAX_REASON_CHARS, Responder, canonical_arguments
from orchestrator.governance.stores.approval_store import ApprovalRecord
from orchestrator.mcp_connections import McpConnection
from orchestrator.model_tool import ModelTool
from orchestrator.process_state_dirs import remove_own, stdio_state_dir
from orchestrator.service import Service
from orchestrator.sessions import (
    Session,
    SessionError,
    SessionExpired,
    SessionLimitReached,
    SessionNotFound,
)

log = logging.getLogger(__name__)

# Where an authenticated HTTP request carries its caller (set by mcp_front/http.py).
OWNER_SCOPE_KEY = "code_interpreter.owner"
# Over stdio the process is the connection: its own id, as stores may be shared by many.
STDIO_CONNECTION = f"stdio-{secrets.token_hex(12)}"
_ARGUMENT_HINT = (
    "Each result names its session_id; pass it back as session_id to continue that session "
    "from a client that does not keep a connection."
)

SessionIdArg = Annotated[
    str | None,
    Field(description="Only to reach a session by id; this connection's session by default."),
]

# The languages themselves are listed in the tool's description, read from the backend.
LanguageArg = Annotated[
    str | None,
    Field(
        max_length=100,
        description="The language of code, one of those the description lists; Python if omitted.",
    ),
]


class ToolFailure(Exception):
    """A call the model can fix or must know about; told to it as an error result."""


def _error(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


@dataclass
class ConnectionSessions:
    """Which session of ours each MCP connection uses (kept in the service's
    `mcp_connections`: in a cluster, shared by every replica)."""

    service: Service
    # One start at a time per connection here: parallel first calls share one new session
    # (through two replicas at once, the store's `bind` keeps one of the two).
    _starting: dict[tuple[str, str], tuple[asyncio.Lock, int]] = field(default_factory=dict)

    async def resolve(
        self, owner: str, connection: str | None, session_id: str | None, *, create: bool = True
    ) -> tuple[Session, str | None]:
        """The session to use, and a note for the model when it is not the one it had.
        Without `create`, a call that has no session to use is refused (files of a session
        that does not exist yet are of no use)."""
        if connection is None or session_id is not None:
            return await self._resolve(owner, connection, session_id, create)
        key = (owner, connection)
        lock, users = self._starting.get(key, (asyncio.Lock(), 0))
        self._starting[key] = (lock, users + 1)
        try:
            async with lock:
                return await self._resolve(owner, connection, session_id, create)
        finally:
            lock, users = self._starting[key]
            if users <= 1:
                del self._starting[key]
            else:
                self._starting[key] = (lock, users - 1)

    async def _known(self, owner: str, connection: str | None) -> str | None:
        if connection is None:
            return None
        try:
            found = await self.service.mcp_connections.get(connection)
        except SessionError as exc:
            raise ToolFailure(f"[error] {exc}") from None
        if isinstance(found, McpConnection) and found.owner == owner:
            return found.session_id
        return None

    async def _resolve(
        self, owner: str, connection: str | None, session_id: str | None, create: bool
    ) -> tuple[Session, str | None]:
        service = self.service
        if session_id is not None:
            try:
                return await service.lifecycle.get(session_id, owner), None
            except SessionError as exc:
                raise ToolFailure(
                    f"[error] {exc}. Omit session_id to use this connection's session."
                ) from None
        note = None
        known = await self._known(owner, connection)
        if known is not None:
            try:
                return await service.lifecycle.get(known, owner), None
            except (SessionExpired, SessionNotFound) as exc:
                note = f"[notice] {exc}; this is a new session: earlier variables are gone."
        if not create:
            raise ToolFailure(
                "[error] there is no session to use yet: run code first, or pass the session_id "
                "an earlier result named."
            )
        try:
            # What the tool starts by itself; clients that never end their connection are
            # common, so what MCP makes expires sooner than other sessions.
            session = await ModelTool(service).start_session(
                owner, idle_timeout_s=service.admission.connection_idle_timeout()
            )
        except SessionLimitReached as exc:
            raise ToolFailure(self._quota_full(owner, exc)) from None
        except (SessionError, SandboxError) as exc:
            raise ToolFailure(f"[error] could not start a sandbox: {exc}") from None
        if connection is None:
            return session, note
        try:
            bound = await service.mcp_connections.bind(connection, owner, session.id, known)
        except SessionError as exc:
            bound = None
            why = f"[error] {exc}"
        else:
            why = "[error] this MCP connection has ended; open a new one"
        if bound == session.id:
            return session, note
        with contextlib.suppress(SessionError):  # not the connection's: not kept
            await service.lifecycle.end(session.id, owner)
        if bound is None:
            raise ToolFailure(why)
        try:  # another call (through this replica or another) made the connection's first
            return await service.lifecycle.get(bound, owner), note
        except SessionError as exc:
            raise ToolFailure(f"[error] {exc}") from None

    def _quota_full(self, owner: str, exc: SessionLimitReached) -> str:
        """The way out of a full quota, in MCP's terms, naming the sessions that hold it."""
        idle_s = self.service.admission.connection_idle_timeout()
        held = sorted(self.service.lifecycle.running(owner), key=lambda s: -s.idle_for())
        listed = "\n".join(
            f"- {s.id}: idle {s.idle_for():.0f} s"
            + (f", ends in {max(0.0, idle_s - s.idle_for()):.0f} s" if s.idle_timeout_s else "")
            for s in held
        )
        return (
            f"[error] could not start a sandbox: {exc}.\nIts sessions:\n{listed}\n"
            "To go on: reuse one MCP connection for many calls (or pass an earlier result's "
            "session_id); close MCP clients you are done with (closing sends DELETE, which ends "
            f"their sandbox); sessions made over MCP end after {idle_s:g} s without a call, so "
            "waiting frees them; or end one with DELETE /v1/sessions/<id> and this API key."
        )

    async def end(self, owner: str, connection: str) -> None:
        """The connection ended (through this replica): so does its session, and the
        connection on every replica."""
        try:
            found = await self.service.mcp_connections.forget(connection)
        except SessionError as exc:
            log.warning("MCP connection %s ended, its session not: %s", connection[:64], exc)
            return
        if found is not None and found.owner == owner and found.session_id is not None:
            with contextlib.suppress(SessionError):  # already expired or deleted
                await self.service.lifecycle.end(found.session_id, owner)


class ApprovalForm(BaseModel):
    """What the client's user is asked for an approval request."""

    approve: bool = Field(description="Let it run?")
    reason: str = Field(
        "", max_length=MAX_REASON_CHARS, description="Why (optional); the code reads it."
    )


_PROMPT_PART_CHARS = 1500  # of the arguments, of the code: a prompt is for reading


def approval_prompt(record: ApprovalRecord) -> str:
    """What the user reads: what waits, in which session, with what, from which code."""
    part = _PROMPT_PART_CHARS

    def clip(text: str) -> str:
        return text if len(text) <= part else f"{text[:part]} [... {len(text) - part} more]"

    if record.kind == "tool_call":
        args = canonical_arguments(record.arguments).decode(errors="replace")
        what = f"call the host tool {record.subject} with {clip(args)}"
    elif record.kind == "command":
        what = f"run the command: {clip(record.subject)}"
    else:
        what = "run this code"
    lines = [f"Approve? Session {record.session_id} (key {record.principal}) wants to {what}."]
    if record.code:
        lines.append(f"The code:\n{clip(record.code)}")
    return "\n".join(lines)


# While this replica waits for its client's answer: answers the client sends through another
# replica reach it too (mcp_front/http.py); on stdio, nothing to do.
AnswersElsewhere = Callable[[Context], contextlib.AbstractAsyncContextManager[None]]


def _no_other_replica(ctx: Context) -> contextlib.AbstractAsyncContextManager[None]:
    return contextlib.nullcontext()


def _elicitor(ctx: Context, answers_elsewhere: AnswersElsewhere) -> Responder:
    """Ask the connection's user to approve or deny; None when its client cannot be asked."""

    async def ask(record: ApprovalRecord) -> tuple[bool, str | None] | None:
        wanted = ClientCapabilities(elicitation=ElicitationCapability())
        if not ctx.request_context.session.check_client_capability(wanted):
            return None
        try:
            async with answers_elsewhere(ctx):
                answer = await ctx.elicit(approval_prompt(record), ApprovalForm)
        except (MCPError, ValueError) as exc:  # no way back to the client, or a bad answer
            log.info("approval %s: the MCP client could not be asked: %s", record.id, exc)
            return None
        if answer.action == "accept":
            return answer.data.approve, answer.data.reason or None
        said = "declined" if answer.action == "decline" else "cancelled"
        return False, f"the MCP client's user {said} the request"

    return ask


def _caller(ctx: Context) -> tuple[str, str | None]:
    """(owner, connection) of a call: stdio is one local connection; HTTP says who and which."""
    request = ctx.request_context.request
    if request is None:
        return LOCAL_OWNER, STDIO_CONNECTION
    scope = request.scope
    owner = scope.get(OWNER_SCOPE_KEY)
    if not isinstance(owner, str):  # the HTTP front always sets it; never guess an owner
        raise ToolFailure("[error] unauthenticated request")
    version = request.headers.get("mcp-protocol-version")
    if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return owner, None  # connectionless: no transport checked an id it may carry
    connection = request.headers.get("mcp-session-id")  # checked by the transport
    return owner, connection or None


async def build_mcp_server(
    service: Service,
    *,
    connections: ConnectionSessions | None = None,
    answers_elsewhere: AnswersElsewhere = _no_other_replica,
) -> tuple[MCPServer, ConnectionSessions]:
    """The MCP server over `service` (started: its host tools and languages are known), and
    its connection-to-session map. `answers_elsewhere`: while an approval is asked of a
    client, what lets its answer come through another replica."""
    languages = await service.views.tool_languages()
    sessions = connections or ConnectionSessions(service)
    server: MCPServer = MCPServer(
        name="code-interpreter",
        version=release.version(),
        instructions="Run code (Python by default) in a stateful sandbox; move files in and "
        "out of its workspace.",
        log_level="WARNING",
    )

    async def session_for(
        ctx: Context, session_id: str | None, *, create: bool = True
    ) -> tuple[Session, str | None]:
        owner, connection = _caller(ctx)
        return await sessions.resolve(owner, connection, session_id, create=create)

    def tool(fn: Callable[..., Awaitable[CallToolResult]], text: str) -> None:
        @functools.wraps(fn)  # the schema is read from fn's signature
        async def told_to_model(*args: Any, **kwargs: Any) -> CallToolResult:
            try:
                return await fn(*args, **kwargs)
            except ToolFailure as exc:
                return _error(str(exc))
            except (SessionError, SandboxError) as exc:
                return _error(f"[error] {exc}")

        server.add_tool(told_to_model, name=fn.__name__, description=text)

    async def code_interpreter(
        code: Annotated[str, Field(min_length=1, description="The code to run.")],
        ctx: Context,
        language: LanguageArg = None,
        session_id: SessionIdArg = None,
    ) -> CallToolResult:
        owner, connection = _caller(ctx)
        try:  # a name that is no language is told before a session is made for it
            canonical_language(language)
        except UnknownLanguage as exc:
            raise ToolFailure(f"[error] {exc}. Omit language to run Python.") from None
        session, note = await sessions.resolve(owner, connection, session_id)
        # The one tool flow, as the REST invoke route runs it, in the connection's session;
        # what waits for a human meanwhile is asked of this client's user too.
        with service.admission.approval_responder(session.id, _elicitor(ctx, answers_elsewhere)):
            outcome = await ModelTool(service).invoke(
                owner, code, session=session, language=language
            )
        rendered = outcome.rendered
        if note:
            rendered.text = f"{note}\n{rendered.text}"
        out = format_output(ToolFormat.MCP, rendered, call_id=None, inline_images=True)
        return CallToolResult.model_validate(out["output"])

    async def run_command(
        command: Annotated[
            str,
            Field(min_length=1, description=ShellToolArguments.model_fields["command"].description),
        ],
        ctx: Context,
        timeout_s: Annotated[
            float | None,
            Field(gt=0, description=ShellToolArguments.model_fields["timeout_s"].description),
        ] = None,
        session_id: SessionIdArg = None,
    ) -> CallToolResult:
        owner, connection = _caller(ctx)
        session, note = await sessions.resolve(owner, connection, session_id)
        # The one shell tool flow, as the REST invoke route runs it, in the connection's session.
        with service.admission.approval_responder(session.id, _elicitor(ctx, answers_elsewhere)):
            outcome = await ModelTool(service).invoke_shell(
                owner, command, session=session, timeout_s=timeout_s
            )
        rendered = outcome.rendered
        if note:
            rendered.text = f"{note}\n{rendered.text}"
        out = format_output(ToolFormat.MCP, rendered, call_id=None, inline_images=True)
        return CallToolResult.model_validate(out["output"])

    async def upload_file(
        path: Annotated[str, Field(description="Where in the workspace (/workspace).")],
        content: Annotated[str, Field(description="The file's content.")],
        ctx: Context,
        encoding: Annotated[
            Literal["text", "base64"], Field(description="How `content` is given.")
        ] = "text",
        session_id: SessionIdArg = None,
    ) -> CallToolResult:
        try:
            data = base64.b64decode(content, validate=True) if encoding == "base64" else None
        except binascii.Error as exc:
            raise ToolFailure(f"[error] content is not valid base64: {exc}") from None
        if data is None:
            data = content.encode()
        try:
            service.admission.check_upload_size(len(data))  # before a session is made for it
            session, _ = await session_for(ctx, session_id)
            info = await service.files.upload(session, path, data)
        except FileTooLarge as exc:
            raise ToolFailure(
                f"[error] {exc}. Upload it in smaller parts and join them with code_interpreter."
            ) from None
        return CallToolResult(
            content=[
                TextContent(type="text", text=f"wrote /workspace/{info.path} ({info.size} bytes)")
            ]
        )

    async def list_files(
        ctx: Context,
        path: Annotated[str, Field(description="A directory; the workspace root if empty.")] = "",
        session_id: SessionIdArg = None,
    ) -> CallToolResult:
        session, _ = await session_for(ctx, session_id, create=False)
        files = await service.files.list_files(session, path, recursive=True)
        lines = [f"{f.path}{'/' if f.type == 'directory' else ''}\t{f.size}" for f in files]
        text = "\n".join(lines) if lines else "(empty)"
        return CallToolResult(content=[TextContent(type="text", text=text)])

    async def download_file(
        path: Annotated[str, Field(description="A file of the workspace.")],
        ctx: Context,
        session_id: SessionIdArg = None,
    ) -> CallToolResult:
        session, _ = await session_for(ctx, session_id, create=False)
        data = await service.files.download(session, path)
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        if mime.startswith("image/") and len(data) <= MAX_INLINE_IMAGE_BYTES:
            encoded = base64.b64encode(data).decode()
            image = ImageContent(type="image", data=encoded, mime_type=mime)
            return CallToolResult(content=[image])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            blob = BlobResourceContents(
                uri=f"file:///workspace/{path.lstrip('/')}",
                mime_type=mime,
                blob=base64.b64encode(data).decode(),
            )
            return CallToolResult(content=[EmbeddedResource(type="resource", resource=blob)])
        limit = service.views.tool_output_chars()  # what a model is shown of one call
        if len(text) > limit:
            text = (
                f"{text[:limit]}\n[note] {len(text) - limit} more characters are left out; "
                "read the rest with code_interpreter."
            )
        return CallToolResult(content=[TextContent(type="text", text=text)])

    host_tools = service.channels.summaries(service.channels.default_tools())
    text = description(
        timeout_s=service.admission.tool_timeout(),
        libraries=LIBRARIES,
        bound_session=True,
        host_tools=host_tools,
        session_note=_ARGUMENT_HINT,
        languages=languages,
        network=service.views.network_of(None),
    )
    tool(code_interpreter, text)
    if service.admission.shell_tool_on():  # off unless the operator turned it on
        shell_text = shell_description(
            timeout_s=service.admission.tool_timeout(),
            libraries=LIBRARIES,
            bound_session=True,
            session_note=_ARGUMENT_HINT,
            network=service.views.network_of(None),
        )
        tool(run_command, shell_text)
    tool(upload_file, "Write a file into the sandbox's workspace (/workspace), text or base64.")
    tool(list_files, "List the files of the sandbox's workspace (/workspace), with sizes.")
    tool(
        download_file,
        "Read a file of the sandbox's workspace: text as text, images as images, "
        "other files as an embedded blob.",
    )
    assert code_interpreter.__name__ == TOOL_NAME and run_command.__name__ == SHELL_TOOL_NAME
    return server, sessions


async def serve_stdio(settings: Settings) -> None:
    """Serve one MCP client over stdin/stdout (how desktop clients launch servers) until it
    leaves; every sandbox is closed on the way out."""
    own = stdio_state_dir(settings.state_dir)  # several clients may each start one
    service = Service(settings.model_copy(update={"state_dir": own}))
    try:
        await service.start()
        try:
            server, _ = await build_mcp_server(service)
            await server.run_stdio_async()
        finally:
            await service.close()
    finally:
        remove_own(own)
