"""An MCP connection opened through another replica, continued here (cluster mode).

The MCP SDK keeps each streamable-HTTP connection (a transport, and the server loop that its
`initialize` made ready) in the memory of the process that opened it, and answers 404 to an id it
does not hold. Here such an id, known to the shared store (orchestrator/mcp_connections.py) as the
caller's, gets a transport under the same id in this process's session manager, with a
connection born ready from the client's `initialize` params as the store kept them (its
capabilities, elicitation among them) and the protocol version its request names. Nothing of the
handshake is asked again; the client never notices the change of replica.

That takes the session manager's private table and the SDK's connection classes: used only with
an SDK whose version was tested (`TESTED_MCP`, checked once); with another, a connection is not
adopted (404 as before: the client opens a new one) and the log says why, once.
"""

from __future__ import annotations

import importlib.metadata
import logging
import secrets
from typing import Any

import anyio
from anyio.abc import TaskStatus
from mcp.server.auth.middleware.bearer_auth import AuthorizationContext
from mcp.server.connection import Connection
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp.shared.transport_context import TransportContext
from mcp_types import InitializeRequestParams
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION
from pydantic import ValidationError

log = logging.getLogger(__name__)

TESTED_MCP = ("2.3.",)  # versions of the `mcp` SDK whose private table this was tested with
# Where an adopted copy's request ids start: past any the opening replica's copy reaches, below
# 2**53 (a JavaScript client's largest exact integer).
FIRST_ID = 1 << 32
ID_SPREAD = 1 << 48
_said: set[str] = set()


def adoptable(manager: StreamableHTTPSessionManager) -> bool:
    """Whether this SDK's session manager can take a connection opened elsewhere."""
    version = importlib.metadata.version("mcp")
    if not version.startswith(TESTED_MCP):
        _say_once(f"the mcp SDK {version} is not one tested ({', '.join(TESTED_MCP)}x)")
        return False
    needed = (
        "_server_instances",
        "_session_owners",
        "_session_creation_lock",
        "_task_group",
        "_lifespan_state",
        "app",
    )
    missing = [name for name in needed if not hasattr(manager, name)]
    if missing or manager.stateless:
        _say_once(f"its session manager lacks {', '.join(missing) or 'state'}")
        return False
    return True


def _say_once(why: str) -> None:
    if why not in _said:
        _said.add(why)
        log.warning(
            "MCP connections opened through another replica are not continued here (%s): "
            "their clients open new ones",
            why,
        )


def holds(manager: StreamableHTTPSessionManager, connection: str) -> bool:
    return connection in manager._server_instances


def held_for(
    manager: StreamableHTTPSessionManager, connection: str, requestor: AuthorizationContext
) -> bool:
    """Held here, for that caller."""
    return holds(manager, connection) and manager._session_owners.get(connection) == requestor


async def discard(manager: StreamableHTTPSessionManager, connection: str) -> None:
    """A connection held here that ended through another replica: refused from now on."""
    transport = manager._server_instances.pop(connection, None)
    manager._session_owners.pop(connection, None)
    if transport is not None and not transport.is_terminated:
        with anyio.CancelScope(shield=True):
            await transport.terminate()


def _version(header: str | None, params: InitializeRequestParams | None) -> str:
    """The protocol version the connection speaks: its request's, else the one its client
    asked for where the SDK would have agreed to it, else the SDK's latest (as it answers)."""
    for asked in (header, params.protocol_version if params else None):
        if asked in HANDSHAKE_PROTOCOL_VERSIONS:
            return asked
    return LATEST_HANDSHAKE_VERSION


def client_params(client: dict[str, Any] | None) -> InitializeRequestParams | None:
    """The client's `initialize` params as the store kept them (None if unusable)."""
    if client is None:
        return None
    try:
        return InitializeRequestParams.model_validate(client)
    except ValidationError:
        return None


async def adopt(
    manager: StreamableHTTPSessionManager,
    connection: str,
    requestor: AuthorizationContext | None,
    client: dict[str, Any] | None,
    protocol_version: str | None,
) -> bool:
    """Hold the connection here, ready: its requests are served as if it was opened here (and
    it idles out here as there). False when this replica holds its most connections already."""
    if holds(manager, connection):
        return True
    if manager.max_sessions is not None and len(manager._server_instances) >= manager.max_sessions:
        return False
    params = client_params(client)
    version = _version(protocol_version, params)
    transport = StreamableHTTPServerTransport(
        mcp_session_id=connection,
        is_json_response_enabled=manager.json_response,
        event_store=manager.event_store,
        security_settings=manager.security_settings,
        retry_interval=manager.retry_interval,
        idle_timeout=manager.session_idle_timeout,
    )

    async def run_server(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with transport.connect() as (read_stream, write_stream):
                dispatcher: JSONRPCDispatcher[TransportContext] = JSONRPCDispatcher(
                    read_stream, write_stream, inline_methods=frozenset({"initialize"})
                )
                # Its requests to the client (an approval's elicitation) numbered apart from
                # those of every other replica's copy of the connection (each SDK copy counts
                # from 1): an answer, which may come through any replica, names one question.
                dispatcher._next_id = FIRST_ID + secrets.randbelow(ID_SPREAD)
                ready = Connection(
                    dispatcher,
                    protocol_version=version,
                    session_id=connection,
                    client_params=params,
                )
                ready.initialized.set()
                if transport.idle_scope is not None and manager.session_idle_timeout is not None:
                    # Idle from now, as one opened here is from its opening request: one whose
                    # first request never reaches it (refused before) still expires.
                    deadline = anyio.current_time() + manager.session_idle_timeout
                    transport.idle_scope.deadline = deadline
                task_status.started()
                idle_scope = transport.idle_scope or anyio.CancelScope()
                with idle_scope:
                    await serve_connection(
                        manager.app,
                        dispatcher,
                        connection=ready,
                        lifespan_state=manager._lifespan_state,
                    )
        except Exception:
            log.exception("MCP connection %s (continued here) failed", connection[:64])
        finally:
            if manager._server_instances.get(connection) is transport:
                await discard(manager, connection)

    task_group = manager._task_group
    if task_group is None:
        raise RuntimeError("the MCP session manager is not running")
    try:
        await task_group.start(run_server)  # connected: requests can be handed to it
    except BaseException:
        with anyio.CancelScope(shield=True):
            await transport.terminate()
        raise
    async with manager._session_creation_lock:  # the SDK's own, around its table
        taken = holds(manager, connection)  # a parallel request adopted it first
        full = manager.max_sessions is not None and (
            len(manager._server_instances) >= manager.max_sessions
        )
        if not taken and not full:
            if requestor is not None:
                manager._session_owners[connection] = requestor
            manager._server_instances[connection] = transport
    if taken or full:
        with anyio.CancelScope(shield=True):
            await transport.terminate()
        return taken
    log.info("MCP connection %s, opened through another replica, continues here", connection[:64])
    return True
