"""One client connection to the proxy, from its first byte to its ledger record: read the
request head, decide, resolve, dial, then tunnel (CONNECT) or forward (plain HTTP).

Every way it can end goes through `run`'s `finally`, so each connection leaves exactly one
record, and nothing the client sends escapes as an exception."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import NoReturn, Protocol

import h11

from code_interpreter_wire.network_policy import IpAddress, NetworkPolicy
from sandbox.egress.credentials import MAX_OUTCOMES, CredentialBindings, HeadTooLarge
from sandbox.egress.decision import decide, denied_address
from sandbox.egress.interception import TlsInterceptor
from sandbox.egress.ledger import MAX_METHOD_CHARS, EgressLedger, EgressRecord
from sandbox.egress.metering import ByteBudget, CapReached, Meter
from sandbox.egress.pipe import CHUNK, pump, send, tunnel
from sandbox.egress.placeholder_scan import PlaceholderScanner
from sandbox.egress.plain_http import Forward, end_to_end
from sandbox.egress.resolver import Unreachable, resolve
from sandbox.egress.responses import CONNECT_ESTABLISHED, answer, refusal
from sandbox.egress.service_guard import service_refusal
from sandbox.egress.settings import EgressSettings
from sandbox.egress.target import (
    BadTarget,
    Target,
    host_header_mismatch,
    parse_absolute,
    parse_connect,
)
from sandbox.egress.terminated import buffered, inner_path, serve_tls
from sandbox.socket_peer import SocketPeer

log = logging.getLogger(__name__)
_LINGER_S = 2.0  # after an early answer, how long unread request bytes are drained
_LINGER_BYTES = 1 << 20
_CHECK_IDLE_EVERY_S = 1.0
_MAX_ADDRESSES_TRIED = 8  # each may take the connect timeout
_EARLY = "bytes were sent before the proxy's answer to CONNECT"
_EARLY_ANSWER = f"{_EARLY}; wait for its 200"


class SessionProxy(Protocol):
    """What an exchange reads and changes of its session's proxy (proxy.py's `EgressProxy`),
    named here so that the proxy, which makes exchanges, is not imported back."""

    policy: NetworkPolicy
    ceiling: NetworkPolicy
    settings: EgressSettings
    ledger: EgressLedger
    budget: ByteBudget
    peer: SocketPeer  # who may connect
    closing: set[asyncio.Task[None]]  # connections still flushing their last bytes
    credentials: CredentialBindings | None  # the session's secrets, swapped in by host
    interceptor: TlsInterceptor | None  # ends TLS: to bound hosts, and on inspected ports

    def end_all(self, note: str) -> None: ...

    def cap_note(self) -> str: ...


class _Answered(Exception):
    """The proxy has answered the client itself (a refusal or an error): the exchange ends."""


class Exchange:
    """The handling of one accepted connection."""

    def __init__(
        self,
        proxy: SessionProxy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.reader = reader
        self.writer = writer
        self.meter = Meter(proxy.budget)
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.started = time.time()
        self.started_mono = asyncio.get_running_loop().time()
        self.host = ""
        self.port = 0
        self.method = ""
        self.allowed = False
        self.reason = "closed before sending a request"
        self.address: str | None = None
        self.end_note: str | None = None
        self.credentials: list[tuple[str, str]] = []  # (secret name, outcome)

    def abort(self, note: str) -> None:
        """End this connection now, both sides, noting why."""
        if self.end_note is None:
            self.end_note = note
        self.writer.transport.abort()
        if self.upstream_writer is not None:
            self.upstream_writer.transport.abort()

    async def run(self) -> None:
        try:
            await self._handle()
        except _Answered:
            pass
        except CapReached:
            self.proxy.end_all(self.proxy.cap_note())
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError) as exc:
            if self.end_note is None:
                self.end_note = f"ended: {exc or type(exc).__name__}"
        except Exception:  # a defect here must not take the proxy down
            log.exception("egress: unexpected error on a connection")
            self.end_note = self.end_note or "ended by an internal error of the proxy"
        finally:
            self._close()
            self.proxy.ledger.add(self._record())

    # ----------------------------------------------------------------------------------------

    async def _handle(self) -> None:
        proxy = self.proxy
        if not self._peer_allowed():
            self.reason = "refused a connection from a process not of the sandbox's uid"
            self.writer.transport.abort()
            return
        request, connection = await self._read_head()
        # Kept in the session's records: a method is a short word, whatever the request says.
        self.method = request.method[:MAX_METHOD_CHARS].decode("ascii", "replace")
        target = await self._target(request)
        self.host, self.port = target.host, target.port
        if proxy.budget.exhausted:
            note = proxy.cap_note()
            await self._answer(403, note, f"egress refused: {note}\n")
        decision = decide(proxy.policy, proxy.ceiling, target.host, target.port)
        if not decision.allowed:
            self.reason = decision.reason
            await self._send_early(refusal(decision.reason, proxy.policy.describe()))
        try:
            addresses = await resolve(target.host, target.port, proxy.settings)
        except Unreachable as exc:
            if exc.status == 403:
                self.reason = exc.reason
                await self._send_early(refusal(exc.reason, proxy.policy.describe()))
            await self._answer(exc.status, exc.reason, f"egress failed: {exc.reason}\n")
        for address in addresses:
            denied = denied_address(proxy.policy, proxy.ceiling, target.host, address, target.port)
            if denied is not None:
                self.reason = denied.reason
                await self._send_early(refusal(denied.reason, proxy.policy.describe()))
        self.allowed = True
        self.reason = decision.reason
        upstream_reader, upstream_writer = await self._dial(target, addresses)
        self.upstream_writer = upstream_writer
        if self.method == "CONNECT" and self._terminates(target):
            await self._terminate(target, connection, upstream_reader, upstream_writer)
        elif self.method == "CONNECT" and self._inspects(target):
            await self._inspect(target, addresses, connection, upstream_reader, upstream_writer)
        elif self.method == "CONNECT":
            await self._opaque(connection, upstream_reader, upstream_writer)
        else:
            request = await self._substituted(request, target.host, target.path, tls=False)
            forward = Forward(
                connection,
                self.reader,
                self.writer,
                upstream_reader,
                upstream_writer,
                self.meter,
                proxy.settings.max_head_bytes,
            )
            await self._watched(lambda: forward.run(request, target))

    def _terminates(self, target: Target) -> bool:
        """Whether this CONNECT is TLS-terminated: a secret is bound to its host."""
        proxy = self.proxy
        return (
            proxy.credentials is not None
            and proxy.interceptor is not None
            and proxy.credentials.binds(target.host)
        )

    def _inspects(self, target: Target) -> bool:
        """Whether this CONNECT's TLS is inspected (not terminated for a swap): the session has
        secrets, none bound to the host, and the port is one the operator has inspected."""
        proxy = self.proxy
        return (
            bool(proxy.credentials)
            and proxy.interceptor is not None
            and target.port in proxy.settings.inspected_ports
        )

    async def _opaque(
        self,
        connection: h11.Connection,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> None:
        """A CONNECT relayed as it is: what the client sends goes on unread."""
        self.writer.write(CONNECT_ESTABLISHED)
        await self.writer.drain()
        early = connection.trailing_data[0]  # sent by the client before our 200 came

        async def client_to_upstream() -> None:
            if early:
                await send(upstream_writer, early, self.meter, up=True)
            await pump(self.reader, upstream_writer, self.meter, up=True)

        await self._watched(
            lambda: tunnel(
                client_to_upstream(),
                pump(upstream_reader, self.writer, self.meter, up=False),
            )
        )

    async def _inspect(
        self,
        target: Target,
        addresses: tuple[IpAddress, ...],
        connection: h11.Connection,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> None:
        """A CONNECT of a session with secrets to a host none is bound to: its TLS is ended
        here (as for a bound host) so that a placeholder sent there is noted, then relayed
        unchanged both ways. Where the proxy cannot see into it (bytes sent before its 200, a
        host whose certificate the proxy does not verify, a server not speaking TLS, a session
        past its new hosts for the minute), the tunnel stays opaque, as for a session without
        secrets, and its record says so."""
        credentials, interceptor = self.proxy.credentials, self.proxy.interceptor
        assert credentials is not None and interceptor is not None
        session_id = self.proxy.ledger.session_id
        paced = f"over {interceptor.new_hosts_per_minute} new hosts for the session this minute"
        why_not = _EARLY if self._early(connection) else None
        if why_not is None and not interceptor.may_take(session_id, target.host):
            why_not = paced
        if why_not is None:
            # The host verified first: a certificate is minted only for a real one.
            why_not = await self._upstream_tls(target, upstream_writer)
            if why_not is None and not interceptor.take(session_id, target.host):
                why_not = paced
            if why_not is None:
                server_context = await interceptor.context_for(target.host)
                if self._early(connection):  # sent while the proxy dialled
                    why_not = _EARLY
            if why_not is not None:  # that connection tried TLS: the sandbox gets a new one
                upstream_writer.transport.abort()
                upstream_reader, upstream_writer = await self._dial(target, addresses)
                self.upstream_writer = upstream_writer
        if why_not is not None:
            self.reason = f"{self.reason}; not inspected by the proxy: {why_not}"
            await self._opaque(connection, upstream_reader, upstream_writer)
            return
        note = "TLS inspected by the proxy (the session has secrets, none bound to the host)"
        if not await self._serve_tls(connection, server_context, note):
            return
        scanner = PlaceholderScanner(credentials.names)
        try:
            # The sandbox's end of sending ends it (TLS passes no half-close on): both sides are
            # then closed as every connection is, their last bytes flushed for a bounded time.
            await self._watched(
                lambda: tunnel(
                    pump(self.reader, upstream_writer, self.meter, up=True, observe=scanner.feed),
                    pump(upstream_reader, self.writer, self.meter, up=False),
                    ends_with_up=True,
                )
            )
        finally:
            scanner.close()
            outcomes = credentials.unbound_outcomes(scanner.names, scanner.unknown_beyond)
            self._note_credentials(outcomes)

    def _early(self, connection: h11.Connection) -> bool:
        """Whether the client sent bytes after its CONNECT before the proxy's 200: TLS started
        here would lose them (a ClientHello), and its handshake would hang."""
        return bool(connection.trailing_data[0] or buffered(self.reader))

    async def _upstream_tls(
        self, target: Target, upstream_writer: asyncio.StreamWriter
    ) -> str | None:
        """Verified TLS of the proxy's own with the host; why it failed, if it did."""
        interceptor = self.proxy.interceptor
        assert interceptor is not None
        settings = self.proxy.settings
        where = f"{target.host}:{target.port}"
        try:
            client_context = interceptor.client_context(settings.upstream_ca_file)
            async with asyncio.timeout(settings.connect_timeout_s):
                await upstream_writer.start_tls(client_context, server_hostname=target.host)
        except ssl.SSLCertVerificationError as exc:
            return f"the certificate of {where} did not verify ({exc.verify_message})"
        except (OSError, TimeoutError) as exc:
            return f"TLS with {where} failed ({exc or type(exc).__name__})"
        return None

    async def _serve_tls(
        self, connection: h11.Connection, server_context: ssl.SSLContext, note: str
    ) -> bool:
        """Answer the CONNECT and end the sandbox's TLS here, with `server_context` (a
        certificate minted for the host); False (the exchange noted why) when its handshake
        fails. Bytes sent before the answer are refused (400)."""
        if self._early(connection):
            await self._answer(400, _EARLY_ANSWER, f"egress refused: {_EARLY_ANSWER}\n")
        self.writer.write(CONNECT_ESTABLISHED)
        await self.writer.drain()
        self.reason = f"{self.reason}; {note}"
        try:
            self.reader, self.writer = await serve_tls(
                self.reader, self.writer, server_context, self.proxy.settings.header_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            if self.end_note is None:  # not ended from outside meanwhile (closing, the cap)
                self.end_note = (
                    f"the sandbox's TLS with the proxy failed ({exc or type(exc).__name__}); "
                    "does it trust the deployment's egress CA?"
                )
            return False
        return True

    async def _terminate(
        self,
        target: Target,
        connection: h11.Connection,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> None:
        """A CONNECT to a host a secret is bound to: verified TLS to the host first (its
        certificate failing is a 502 before anything is read from the sandbox), then the
        sandbox's TLS ended here with a certificate minted for the host, and its request
        forwarded with its placeholders swapped. One request per tunnel (`Connection: close`)."""
        settings = self.proxy.settings
        if self._early(connection):
            await self._answer(400, _EARLY_ANSWER, f"egress refused: {_EARLY_ANSWER}\n")
        failed = await self._upstream_tls(target, upstream_writer)
        if failed is not None:
            await self._answer(
                502, f"{failed}; nothing sent", f"egress failed: {failed}; nothing sent\n"
            )
        interceptor = self.proxy.interceptor
        assert interceptor is not None
        if not interceptor.take(self.proxy.ledger.session_id, target.host):
            why = (
                f"over {interceptor.new_hosts_per_minute} new hosts whose TLS the proxy ends for "
                "the session this minute; nothing sent: try again in a minute"
            )
            await self._answer(429, why, f"egress refused: {why}\n")
        server_context = await interceptor.context_for(target.host)
        note = "TLS terminated by the proxy (a secret is bound to the host)"
        if not await self._serve_tls(connection, server_context, note):
            return
        request, inner = await self._read_head()
        try:
            path = inner_path(request.target, target)
        except BadTarget as exc:
            await self._answer(400, str(exc), f"egress refused: {exc}\n")
        await self._host_header_agrees(request, target, 443)
        request = await self._substituted(request, target.host, path)
        forward = Forward(
            inner,
            self.reader,
            self.writer,
            upstream_reader,
            upstream_writer,
            self.meter,
            settings.max_head_bytes,
            default_port=443,
        )
        await self._watched(lambda: forward.run(request, replace(target, path=path)))

    async def _substituted(
        self, request: h11.Request, host: str, path: str, *, tls: bool = True
    ) -> h11.Request:
        """`request` with the placeholders that may go to (host, its method, path) swapped for
        their values (in its end-to-end headers only; never in plain HTTP: `tls` False), each
        noted for the record (once per connection, in its record line: nothing is logged per
        request, which the sandbox could repeat at will). A head that the values would make
        longer than the proxy's limit is answered 431."""
        credentials = self.proxy.credentials
        if credentials is None:
            return request
        method = request.method.decode("ascii", "replace")
        try:
            result = credentials.substitute(
                end_to_end(list(request.headers)),
                host=host,
                method=method,
                path=path,
                tls=tls,
                max_head_bytes=self.proxy.settings.max_head_bytes,
                request_line_bytes=len(request.method) + len(request.target) + 11,
            )
        except HeadTooLarge as exc:
            self._note_credentials(exc.outcomes)
            await self._answer(431, str(exc), f"egress refused: {exc}\n")
        self._note_credentials(result.outcomes)
        if not result.substituted:
            return request
        try:
            return h11.Request(
                method=request.method,
                target=request.target,
                headers=result.headers,
                http_version=request.http_version,
            )
        except h11.LocalProtocolError:  # its message would hold the value
            raise ConnectionError("a header with a secret swapped in is not valid HTTP") from None

    def _note_credentials(self, outcomes: tuple[tuple[str, str], ...]) -> None:
        """Outcomes for the record, at most MAX_OUTCOMES per connection."""
        room = MAX_OUTCOMES - len(self.credentials)
        self.credentials.extend(outcomes[: max(room, 0)])

    def _peer_allowed(self) -> bool:
        if self.proxy.peer.uid is None:
            return True
        sock: socket.socket | None = self.writer.get_extra_info("socket")
        return sock is not None and self.proxy.peer.allows(sock)

    async def _read_head(self) -> tuple[h11.Request, h11.Connection]:
        settings = self.proxy.settings
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=settings.max_head_bytes)
        try:
            async with asyncio.timeout(settings.header_timeout_s):
                while True:
                    event = connection.next_event()
                    if event is h11.NEED_DATA:
                        connection.receive_data(await self.reader.read(CHUNK))
                    elif isinstance(event, h11.Request):
                        return event, connection
                    else:  # the client closed before a whole request
                        raise _Answered()
        except TimeoutError:
            limit = settings.header_timeout_s
            await self._answer(
                408,
                f"the request head did not arrive within {limit:g} s",
                f"egress refused: the request head did not arrive within {limit:g} s\n",
            )
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            if status == 431:
                why = f"the request head is longer than {settings.max_head_bytes} bytes"
            else:
                why = f"not an HTTP proxy request: {exc}"
            await self._answer(
                status,
                why,
                f"egress refused: {why}. This is an HTTP proxy: send CONNECT host:port for TLS "
                "or an absolute URL (GET http://host/path) for plain HTTP.\n",
            )

    async def _target(self, request: h11.Request) -> Target:
        try:
            if request.method == b"CONNECT":
                target = parse_connect(request.target)
                default_port = target.port
            else:
                target = parse_absolute(request.target)
                default_port = 80
        except BadTarget as exc:
            await self._answer(400, str(exc), f"egress refused: {exc}\n")
        self.host, self.port = target.host, target.port  # what a refusal is recorded for
        await self._host_header_agrees(request, target, default_port)
        return target

    async def _host_header_agrees(
        self, request: h11.Request, target: Target, default_port: int
    ) -> None:
        """A Host header naming another place than the target is refused (403)."""
        for name, value in request.headers:
            if name == b"host":
                mismatch = host_header_mismatch(value, target, default_port)
                if mismatch is not None:
                    await self._answer(403, mismatch, f"egress refused: {mismatch}\n")

    async def _dial(
        self, target: Target, addresses: tuple[IpAddress, ...]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        settings = self.proxy.settings
        timeout = settings.connect_timeout_s
        failures = []
        for address in addresses[:_MAX_ADDRESSES_TRIED]:
            # Here, on the very address about to be dialled: whatever allowed the name, the
            # service's own listeners stay out of reach (sandbox/egress/service_guard.py).
            refused = await service_refusal(target.host, address, target.port, settings)
            if refused is not None:
                self.reason = refused
                why = f"egress refused: {refused}"
                await self._send_early(answer(403, why, f"{why}\n"))
            self.address = str(address)
            try:
                async with asyncio.timeout(timeout):
                    return await asyncio.open_connection(str(address), target.port, limit=CHUNK)
            except TimeoutError:
                failures.append(f"{address}: no answer within {timeout:g} s")
            except OSError as exc:
                failures.append(f"{address}: {exc.strerror or exc}")
        why = f"could not connect to {target.host}:{target.port} ({'; '.join(failures)})"
        await self._answer(502, why, f"egress failed: {why}\n")

    async def _watched(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run the relaying, ending it when no byte has moved either way for the idle time."""
        idle = self.proxy.settings.idle_timeout_s

        async def watch() -> None:
            while True:
                await asyncio.sleep(min(_CHECK_IDLE_EVERY_S, idle / 4))
                if self.meter.idle_for() >= idle:
                    self.abort(f"closed after {idle:g} s with no byte either way")
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await work()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _answer(self, status: int, reason: str, body: str) -> NoReturn:
        """Answer with an error of the proxy's own and end the exchange."""
        self.reason = reason
        await self._send_early(answer(status, reason, body))

    async def _send_early(self, response: bytes) -> NoReturn:
        """Send an answer before the request was read whole, then drain what the client still
        sends for a moment: closing with unread bytes would reset the connection and the
        client might never see the answer."""
        self.allowed = False
        with contextlib.suppress(OSError):
            self.writer.write(response)
            await self.writer.drain()
            if self.writer.can_write_eof():
                self.writer.write_eof()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_LINGER_S):
                    drained = 0
                    while drained < _LINGER_BYTES:
                        chunk = await self.reader.read(CHUNK)
                        if not chunk:
                            break
                        drained += len(chunk)
        raise _Answered()

    def _close(self) -> None:
        for writer in (self.writer, self.upstream_writer):
            if writer is None:
                continue
            if self.end_note:
                writer.transport.abort()  # an abnormal end: no flushing to a peer that stalls
            else:
                # Flushes what is buffered, for a bounded time: a peer that never reads it is
                # cut, and nothing of the connection outlives that. A transport closing already
                # is left alone (a TLS one, closed twice, loses its state: CPython 3.11).
                if writer.transport.is_closing():
                    continue
                writer.close()
                if writer.transport.get_write_buffer_size():
                    flushing = asyncio.ensure_future(_flushed_or_cut(writer))
                    self.proxy.closing.add(flushing)
                    flushing.add_done_callback(self.proxy.closing.discard)

    def _record(self) -> EgressRecord:
        reason = self.reason
        if self.end_note and self.end_note not in reason:
            reason = f"{reason}; {self.end_note}"
        return EgressRecord(
            time=self.started,
            host=self.host,
            port=self.port,
            method=self.method,
            allowed=self.allowed,
            reason=reason,
            address=self.address,
            bytes_up=self.meter.up,
            bytes_down=self.meter.down,
            duration_s=asyncio.get_running_loop().time() - self.started_mono,
            credentials=tuple(self.credentials),
        )


FLUSH_S = 10.0  # the most a closing connection may take to deliver its last bytes


async def _flushed_or_cut(writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(FLUSH_S):
            await writer.wait_closed()
    except (TimeoutError, OSError):
        writer.transport.abort()
