"""The egress proxy of one session: listens on the Unix socket in the session's egress
directory (bound read-only into the sandbox at /run/egress), where the forwarder inside the
sandbox sends each TCP connection made to its 127.0.0.1 proxy port.

Who can connect mirrors sandbox/host_channel.py: as root the socket belongs to root and the
sandbox's group only (0660); otherwise it is 0666 and the peer-uid check (SO_PEERCRED) on every
connection is what holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.channel_dir import MAX_SOCKET_PATH
from sandbox.egress.credentials import CredentialBindings
from sandbox.egress.exchange import Exchange
from sandbox.egress.interception import TlsInterceptor
from sandbox.egress.ledger import EgressLedger, EgressRecord
from sandbox.egress.metering import ByteBudget
from sandbox.egress.pipe import CHUNK
from sandbox.egress.responses import answer
from sandbox.egress.settings import EgressSettings
from sandbox.egress.slots import FULL, UNCHECKED, Refusal, Slots
from sandbox.socket_peer import SocketPeer

log = logging.getLogger(__name__)
_BACKLOG = 64
_LINGERING_REFUSALS = 8  # refusals over the cap that may read the client's request first
_LINGER_S = 1.0


class EgressProxy:
    """One session's proxy: its policy, the deployment's ceiling, limits and ledger."""

    def __init__(
        self,
        *,
        policy: NetworkPolicy,
        ceiling: NetworkPolicy,
        settings: EgressSettings,
        ledger: EgressLedger,
        slots: Sequence[Slots] = (),
        credentials: CredentialBindings | None = None,
        interceptor: TlsInterceptor | None = None,
    ) -> None:
        """`slots`: caps this proxy shares with others, each taken per connection in order
        (its key's sessions, then the service's); none: only this session's cap.
        `credentials`: the session's secrets, swapped for their placeholders in the headers of
        HTTPS requests to their hosts (never of plain HTTP ones); `interceptor` (the
        deployment's CA) is what lets it, by terminating the TLS of CONNECTs to those hosts
        (others stay opaque tunnels): without it nothing is swapped."""
        if credentials is not None and len(credentials) and interceptor is None:
            log.warning(
                "egress session=%s: secrets without a TLS interceptor are never swapped in: "
                "HTTPS to their hosts stays an opaque tunnel carrying the placeholders "
                "unchanged, and plain HTTP never gets a value",
                ledger.session_id,
            )
        self.credentials = credentials
        self.interceptor = interceptor
        self.policy = policy
        self.slots = tuple(slots)
        self.ceiling = ceiling
        self.settings = settings
        self.ledger = ledger
        self.budget = ByteBudget(ledger, settings.max_bytes_per_session)
        self.peer = SocketPeer(None)
        # Connections still flushing their last bytes after their end, each for a bounded time.
        self.closing: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Future[None] | None = None
        self._socket_path: Path | None = None
        self._exchanges: set[Exchange] = set()
        self._tasks: set[asyncio.Future[None]] = set()
        self._lingering: set[asyncio.Future[None]] = set()
        self._admitted = 0  # connections within the cap, open now
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections being handled now, the ones answered for being over the cap included."""
        return len(self._exchanges)

    async def start(
        self,
        socket_path: Path,
        *,
        peer_uid: int | None,
        peer_gid: int | None,
        peer_program: str | None = None,
    ) -> None:
        """Bind and listen on `socket_path`; `peer_uid` None accepts any uid (tests);
        `peer_program`: the peer's program too, where the uid alone does not say it is the
        sandbox (gVisor's gofer)."""
        if self._accepting is not None or self._closed:
            raise RuntimeError("an egress proxy starts once")
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"the egress socket path {socket_path} is longer than Unix sockets allow; use a "
                "shorter state directory"
            )
        self.peer = SocketPeer(peer_uid, peer_program)
        sock = await asyncio.to_thread(_listen, socket_path, peer_gid)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.ensure_future(self._accept_loop(sock))
        self._socket_path = socket_path

    async def close(self) -> None:
        """Stop listening and end every open connection (each still leaves its record)."""
        if self._closed:
            return
        self._closed = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        self.end_all("closed: the session's egress proxy stopped")
        tasks = [*self._tasks, *self.closing, *self._lingering]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.interceptor is not None:
            self.interceptor.forget(self.ledger.session_id)
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()

    def end_all(self, note: str) -> None:
        """End every open connection now (the byte cap, or closing)."""
        for exchange in list(self._exchanges):
            exchange.abort(note)

    def cap_note(self) -> str:
        return (
            f"the session's egress byte cap of {self.settings.max_bytes_per_session} bytes "
            "is used up"
        )

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept one connection at a time. Within the caps it is served by a task of its own;
        past them it is answered 503 and closed on the spot, before the next accept, so a
        sandbox connecting in a loop holds none of the service's descriptors beyond its cap.
        What waits meanwhile waits in the kernel's listen backlog, not in this process."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # descriptors exhausted: wait, rather than spin or stop
                log.warning("egress: accepting a connection failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            try:
                refusal = await self._over_cap()
            except asyncio.CancelledError:  # closing while a shared count was asked
                conn.close()
                raise
            except Exception:  # a count that failed: this connection is refused, no more
                log.exception("egress: the connection caps could not be checked")
                refusal = Refusal(UNCHECKED, "checking them failed; retry in a moment")
            if refusal is not None:
                self._refuse_at_once(conn, refusal)
                continue
            self._admitted += 1
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn, limit=CHUNK)
            except BaseException:
                self._release()
                conn.close()
                raise
            task = asyncio.ensure_future(self._serve(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _over_cap(self) -> Refusal | None:
        """Why one more connection may not be served now, or None (and then a slot is taken)."""
        cap = self.settings.max_connections_per_session
        if self._admitted >= cap:
            return Refusal(
                FULL,
                f"this sandbox already has {cap} connections open through the proxy, the "
                "session's cap (egress_max_connections_per_session); close some and retry",
            )
        held = 0
        try:
            for slots in self.slots:
                refusal = await slots.take()
                if refusal is not None:
                    return refusal
                held += 1
        finally:
            if held < len(self.slots):  # refused, or closing while one was asked
                for taken in self.slots[:held]:
                    taken.give_back()
        return None

    def _release(self) -> None:
        self._admitted -= 1
        for slots in self.slots:
            slots.give_back()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        exchange = Exchange(self, reader, writer)
        self._exchanges.add(exchange)
        try:
            await exchange.run()
        finally:
            self._exchanges.discard(exchange)
            self._release()

    def _refuse_at_once(self, conn: socket.socket, refusal: Refusal) -> None:
        """Answer 503 and close. A few refusals at a time linger a moment to read what the
        client sent (closing a Unix socket with unread bytes resets it, and the client would
        lose the answer); past those, the answer is sent and the socket closed at once."""
        text = refusal.text
        self.ledger.add(_record_of_refusal_before_reading(text))
        reply = answer(503, f"{refusal.reason}: {text}", f"egress refused: {text}.\n")
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(reply)  # a few hundred bytes into a fresh socket's empty buffer
        if len(self._lingering) >= _LINGERING_REFUSALS:
            conn.close()
            return
        lingering = asyncio.ensure_future(_drain_then_close(conn))
        self._lingering.add(lingering)
        lingering.add_done_callback(self._lingering.discard)


async def _drain_then_close(conn: socket.socket) -> None:
    """Read and drop what the client sends, for a moment and a few chunks, then close."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(_LINGER_S):
            for _ in range(16):
                if not await loop.sock_recv(conn, CHUNK):
                    break
    except (TimeoutError, OSError):
        pass
    finally:
        conn.close()


def _record_of_refusal_before_reading(reason: str) -> EgressRecord:
    """The record of a connection refused before its request was read."""
    return EgressRecord(
        time=time.time(),
        host="",
        port=0,
        method="",
        allowed=False,
        reason=reason,
        address=None,
        bytes_up=0,
        bytes_down=0,
        duration_s=0.0,
    )


def _listen(path: Path, peer_gid: int | None) -> socket.socket:
    """The listening socket at `path`, open to the sandbox only (see the module's docstring)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        if peer_gid is not None and os.geteuid() == 0:
            os.chown(path, 0, peer_gid)
            path.chmod(0o660)
        else:
            path.chmod(0o666)  # the peer-uid check is the gate here
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
