"""How the service is served over HTTP: uvicorn, with each connection watched by a
ConnectionGuard (orchestrator/connection_guard.py) for a request's head and body deadlines, a
client that stops taking its answers, and the per-address and total connection caps, none of
which uvicorn has.

Why uvicorn and a guard of our own rather than another server: no ASGI server caps connections
per client address, so that part is ours whatever serves; hypercorn's `read_timeout` restarts
on every read (a byte every few seconds holds a connection for ever) and granian's header
timeout has no body rate; both would change how streaming answers, WebSockets and lifespan
behave. The guard hooks into uvicorn's h11 protocol at the points it already has (a connection
made and lost, data received, writing paused and resumed, an answer complete, an upgrade), so
parsing, streaming and WebSockets stay uvicorn's own; tests/orchestrator/test_uvicorn_hooks.py
checks that those points are still there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, cast

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from orchestrator.caller_mark import CallerMark, attach
from orchestrator.config import Settings
from orchestrator.connection_guard import ConnectionGuard, ConnectionLimits, Refusal
from sandbox.descriptors import raise_descriptor_limit

log = logging.getLogger(__name__)

_REASONS = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}
_STARTUP_FAILURE = 3  # uvicorn's own exit status when it cannot start


def connection_cap(wanted: int, open_files: int) -> int:
    """The total connection cap in force: `wanted`, lowered so that a quarter of the
    descriptors (at least 1,024, at most half) stays for the service's own work: kernels,
    files, Docker and the store."""
    if open_files == resource.RLIM_INFINITY:
        return wanted
    reserve = min(open_files // 2, max(1024, open_files // 4))
    return max(1, min(wanted, open_files - reserve))


def address_cap(wanted: int, total_wanted: int, total_cap: int) -> int:
    """The per-address cap in force: `wanted`, unless the total cap was lowered for want of
    descriptors: then at most half of it, so that no one address takes them all. (Set as the
    operator chose, it may equal the total: behind a reverse proxy, every client is one.)"""
    if total_cap >= total_wanted:
        return wanted
    return max(1, min(wanted, total_cap // 2))


def accept_batch(open_files: int, cap: int) -> int:
    """How many connections one wake-up of the event loop accepts before the guard sees any
    of them (asyncio takes it from the listen backlog). asyncio has up to four such batches in
    hand before the refused ones' descriptors are closed (accepted, transport made, refused,
    closed), so four batches must fit in half of the descriptors the cap leaves over, or a
    burst runs the service out of them; 256 at most."""
    if open_files == resource.RLIM_INFINITY:
        return 256
    return max(16, min(256, (open_files - cap) // 8))


# The kernel's queue of connections not yet accepted: they hold no descriptor of the service's,
# so it may be long (uvicorn's default), and a burst does not make clients retry their SYNs.
KERNEL_BACKLOG = 2048


class _ListeningSocket(socket.socket):
    """A socket whose kernel queue stays KERNEL_BACKLOG long whatever asyncio listens with:
    asyncio uses one number for the queue and for its batch of accepts (accept_batch)."""

    def listen(self, backlog: int = KERNEL_BACKLOG) -> None:
        super().listen(max(backlog, KERNEL_BACKLOG))


def connection_limits(settings: Settings, open_files: int) -> ConnectionLimits:
    cap = connection_cap(settings.http_max_connections, open_files)
    per_address = address_cap(
        settings.http_max_connections_per_address, settings.http_max_connections, cap
    )
    if cap < settings.http_max_connections:
        log.warning(
            "http_max_connections lowered from %d to %d: the process may open %d files and "
            "keeps the rest for its own work (raise the limit, e.g. LimitNOFILE= in systemd)",
            settings.http_max_connections,
            cap,
            open_files,
        )
    if per_address < settings.http_max_connections_per_address:
        log.warning(
            "http_max_connections_per_address lowered from %d to %d: half the total cap of %d "
            "connections, so that one address cannot hold them all",
            settings.http_max_connections_per_address,
            per_address,
            cap,
        )
    return ConnectionLimits(
        header_timeout_s=settings.http_header_timeout_s,
        body_min_rate=settings.http_body_min_rate,
        write_stall_timeout_s=settings.http_write_stall_timeout_s,
        max_per_address=per_address,
        max_total=cap,
    )


def _answer(refusal: Refusal) -> bytes:
    body = json.dumps({"error": {"type": refusal.kind, "message": refusal.message}}).encode()
    head = (
        f"HTTP/1.1 {refusal.status} {_REASONS[refusal.status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n"
        + ("retry-after: 1\r\n" if refusal.status in (429, 503) else "")
        + "\r\n"
    )
    return head.encode() + body


class _PauseNotingFlow(FlowControl):
    """uvicorn's flow control, remembering a pause of reading until the guard has seen it: a
    short pause between two sweeps is still time the client could not send."""

    paused_unseen = False

    def pause_reading(self) -> None:
        self.paused_unseen = True
        super().pause_reading()


def answer_at_once(transport: asyncio.BaseTransport) -> None:
    """No Nagle delay on a TCP connection: an answer goes out in several writes (head, body),
    and Nagle holds the second until the first is acknowledged, which a client delays by up to
    40 ms on a kept-alive connection (measured: every request after a connection's first took
    44 ms, `/healthz` included). asyncio sets TCP_NODELAY only on sockets whose protocol number
    says TCP; set here for every connection, however its listening socket was made."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, telling the guard what each connection waits for and whether
    its request's caller has proven a key (a CallerMark in each request's scope)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received = 0
        self._admitted = False
        self._upgraded = False
        self._mark: CallerMark | None = None
        self._marked_cycle: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        answer_at_once(transport)
        self.flow = self._flow = _PauseNotingFlow(transport)
        try:
            refusal = self.guard.admit(self, self.client[0] if self.client else "")
        except Exception:  # never a connection the guard does not count
            log.exception("admitting an HTTP connection failed; it is closed")
            self.connections.discard(self)
            self.transport.abort()
            return
        if refusal is not None:
            self.connections.discard(self)
            self.transport.write(_answer(refusal))
            self._close()
            return
        self._admitted = True
        self.guard.waiting(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._admitted = False
        self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return  # refused or dropped: nothing more is read
        self.received += len(data)
        super().data_received(data)
        self._tell_guard()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._admitted:
            self._tell_guard()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._admitted:
            self.guard.write_paused(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._admitted:
            self.guard.write_resumed(self)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True
        # No new request cycle comes for an upgrade: what an earlier request of this
        # connection proved does not carry over to the WebSocket, which proves its own.
        self.guard.caller(self, proven=False)
        self.guard.detached(self)
        self._mark = mark = self._new_mark()
        super().handle_websocket_upgrade(event)
        # The WebSocket's protocol has its own scope, made when its handshake is read (now or
        # later): the app it calls puts this connection's mark in it first. Its task has not
        # run yet, so it calls this one.
        websocket = self.transport.get_protocol()
        app = websocket.app  # type: ignore[attr-defined]
        websocket.app = partial(_marked, app, mark)  # type: ignore[attr-defined]

    def _tell_guard(self) -> None:
        if self._upgraded:
            return
        if self.transport.is_closing():
            if self.unsent():  # it closes once the client has taken the rest: it must
                self.guard.write_paused(self)
            return
        cycle = self.cycle
        if cycle is not None and cycle is not self._marked_cycle:
            # A new request, whose app has not run yet: its caller is not proven.
            self._marked_cycle = cycle
            self._mark = self._new_mark()
            attach(cast(dict[str, Any], cycle.scope), self._mark)
            self.guard.caller(self, proven=False)
        if cycle is None or cycle.response_complete:
            self.guard.waiting(self)
        elif self.conn.their_state is h11.SEND_BODY:
            self.guard.reading_body(self)
        else:
            self.guard.busy(self)

    def _new_mark(self) -> CallerMark:
        mark = CallerMark(lambda: self._proven(mark))
        return mark

    def _proven(self, mark: CallerMark) -> None:
        if mark is self._mark and self._admitted:
            self.guard.caller(self, proven=True)

    # --- what the guard asks (connection_guard.Watched)
    def held_by_server(self) -> bool:
        paused, self._flow.paused_unseen = self._flow.paused_unseen, False
        return (
            paused
            or self._flow.read_paused
            or (self.cycle is not None and self.cycle.waiting_for_100_continue)
        )

    def body_is_a_stream(self) -> bool:
        return self._mark is not None and self._mark.streams_body

    def unsent(self) -> int:
        return self.transport.get_write_buffer_size()

    def is_gone(self) -> bool:
        return self.transport.is_closing()

    def drop(self, refusal: Refusal | None) -> None:
        self._admitted = False
        if self.transport.is_closing():
            if self.unsent():  # closing, but waiting on a client that takes nothing
                self.transport.abort()
            return
        if self._upgraded:
            self.transport.abort()  # a WebSocket: no HTTP answer fits
            return
        if refusal is not None and self._answer_due():
            self.transport.write(_answer(refusal))
        if self.cycle is not None:
            # What the app sends from now on goes nowhere (as once the connection is lost),
            # never after this answer on the wire.
            self.cycle.disconnected = True
        self._close()

    def _answer_due(self) -> bool:
        """A request is part way in and nothing has been answered to it."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return not cycle.response_started
        return self.conn.our_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def _close(self) -> None:
        """Close, flushing a short answer; a client that does not read it is cut off rather
        than left holding the connection."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()


async def _marked(app: Callable[..., Any], mark: CallerMark, scope: Any, *args: Any) -> None:
    attach(scope, mark)
    await app(scope, *args)


def guarded_protocol(connection_guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates for each connection, bound to one guard."""

    class Bound(GuardedH11Protocol):
        guard = connection_guard

    return Bound


def listening_socket(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound here (port 0: any free one) so that its port is
    known before the app is made (the sandboxes' egress proxies refuse it) and nothing can
    take the port in between. OSError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, so that asyncio treats its connections as TCP (TCP_NODELAY) too.
    sock = _ListeningSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(app: Any, settings: Settings, sock: socket.socket) -> None:
    """Serve `app` on `sock` until told to stop: every way the service is run over HTTP comes
    here."""
    open_files = raise_descriptor_limit()
    limits = connection_limits(settings, open_files)
    config = uvicorn.Config(
        app,
        http=guarded_protocol(ConnectionGuard(limits)),
        backlog=accept_batch(open_files, limits.max_total),
        # Whose X-Forwarded-For names the client: the key-guessing throttle counts by it (the
        # connection caps count the TCP peer, which is the proxy).
        proxy_headers=bool(settings.forwarded_allow_ips.strip()),
        forwarded_allow_ips=settings.forwarded_allow_ips.strip() or None,
        log_level="info",
        timeout_graceful_shutdown=10,
        # A terminal's WebSocket: messages of at most 1 MiB, a few queued, per socket.
        ws_max_size=1 << 20,
        ws_max_queue=4,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d", shown, port)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(_STARTUP_FAILURE)
