"""Reading a kernel's sockets for its whole life, within a stated bound of memory.

Nothing a kernel sends may pile up in the service: between executions a sandbox can publish
without end, and the code holds the HMAC key, so any message may be forged. So for each kernel
generation one task per socket reads without pause: iopub messages go to the request being
followed, or are dropped; shell replies go to whoever waits for them; control replies are
dropped. ZeroMQ itself holds at most `RECEIVE_QUEUE_MESSAGES` messages per socket, none with a
frame over the frame limit (`ZMQ_MAXMSGSIZE`: ZeroMQ drops the connection on a larger frame and
does not reconnect by itself, so the iopub socket is then replaced, losing that message); the
kernel keeps any backlog on its side, where its memory limit applies. Between receiving and
handling, an inbox holds at most `INBOX_BYTES` (or `INBOX_MESSAGES`), plus one message; once
handled, no message is held while the next is awaited (a 200 MB reply once stayed until then).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient

from sandbox.kernel.late_output import MARK_TYPE, Flush, send_flush
from sandbox.kernel.wire import (
    BAD_SIGNATURE,
    Frame,
    KernelMessage,
    Malformed,
    parse_off_loop,
    peek_parent_id,
    receive_frames,
)

log = logging.getLogger(__name__)

# Complete messages ZeroMQ may queue per socket before it leaves the rest with the kernel.
RECEIVE_QUEUE_MESSAGES = 2
# Between receiving iopub messages and handling them: room for bursts of small outputs (a loop
# of displays) that handling one by one cannot keep up with, bounded in bytes and in count.
INBOX_BYTES = 32 << 20
INBOX_MESSAGES = 10_000
# The floor of the frame limit: room for a 200 MB print, which the output cap then trims.
MIN_FRAME_BYTES = 256 << 20
# After the shell's execute_reply, how long iopub may stay quiet before the run is over even
# though its idle status never came (PUB/SUB drops messages when a subscriber falls behind).
QUIET_AFTER_REPLY_S = 2.0
MAX_WAIT_AFTER_REPLY_S = 10.0
# Where iopub crosses a slow relay (`output_moved`: a gVisor machine's agent, ~85 MB/s, slower
# on a loaded host), a message still moving may take longer than that to cross: the wait goes
# on while its bytes move, this long at most (a background flood does not hold a call for ever).
MAX_WAIT_AFTER_RELAYED_REPLY_S = 60.0
# A kernel that publishes after its idle (late_output.py): the flush's marker ends the call, or
# else iopub staying quiet this long (its code was replaced or the kernel's thread hangs), or
# this long at most (a backlog of a million prints is still being published; a timer printing
# forever).
QUIET_BEFORE_MARK_S = 2.0
MAX_WAIT_FOR_MARK_S = 30.0
# A status message's one field is a word: anything longer in it is cut before decoding.
STATUS_TEXT_CHARS = 1000


def frame_limit_bytes(result_limit_bytes: int, output_limit_chars: int) -> int:
    """The largest frame we take: well above anything the output limits could keep."""
    return max(MIN_FRAME_BYTES, 4 * result_limit_bytes + 4 * output_limit_chars)


OutputHandler = Callable[[KernelMessage], Awaitable[None]]


class Inbox:
    """Raw messages received but not yet handled; a full inbox stops the receiving, which
    leaves the backlog with ZeroMQ and the kernel. The first message is always taken in."""

    def __init__(self, max_bytes: int = INBOX_BYTES, max_messages: int = INBOX_MESSAGES) -> None:
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.items: deque[tuple[list[Frame], int]] = deque()
        self.size = 0
        self.not_empty = asyncio.Event()
        self.not_full = asyncio.Event()

    async def put(self, frames: list[Frame]) -> None:
        size = sum(len(f) for f in frames)
        while self.items and (
            self.size + size > self.max_bytes or len(self.items) >= self.max_messages
        ):
            self.not_full.clear()
            await self.not_full.wait()
        self.items.append((frames, size))
        self.size += size
        self.not_empty.set()

    async def get(self) -> list[Frame]:
        while not self.items:
            self.not_empty.clear()
            await self.not_empty.wait()
        frames, size = self.items.popleft()
        self.size -= size
        self.not_full.set()
        return frames


@dataclass
class Watch:
    """One request being followed: its output handler, and how far it has got."""

    msg_id: str
    on_output: OutputHandler | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    malformed: int = 0  # messages dropped as unusable while this request was followed
    end_unconfirmed: bool = False  # ended by the quiet after the reply: no idle status came
    last_message: float = 0.0  # when a message of this request was last taken (monotonic)
    # The request proving this one's output is all in (late_output.py): until its marker, what
    # comes under its id is this request's late output.
    flush: Flush | None = None


class KernelChannels:
    """The reading side of one kernel generation's sockets (sending stays with the client)."""

    def __init__(
        self,
        client: AsyncKernelClient,
        *,
        frame_limit: int,
        text_limit: int = 1_000_000,
        output_moved: Callable[[], float] | None = None,
    ) -> None:
        self.client = client
        # When bytes of iopub last moved toward us below ZeroMQ (a backend that relays the
        # kernel's sockets, in time.monotonic()); None where ZeroMQ reads the kernel directly.
        # A message still crossing a slow relay is activity too: its reply, on another
        # socket, may overtake it by seconds.
        self.output_moved = output_moved
        self.frame_limit = frame_limit
        self.text_limit = text_limit  # a reply's texts are kept up to this many characters
        context = client.context
        context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        context.setsockopt(zmq.MAXMSGSIZE, frame_limit)
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=True)
        self.watch: Watch | None = None
        self.replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.iopub_seen = asyncio.Event()  # any message arrived: our subscription is live
        self.shell_received = 0  # messages read from the shell socket (for diagnostics)
        self._shell_sent = asyncio.Event()  # a request went out on shell (wire._readable)
        self.inbox = Inbox()
        self.handling = False  # an iopub message is being handled
        self.handler_free = asyncio.Event()  # set while no iopub message is being handled
        self.handler_free.set()
        self.last_activity = time.monotonic()  # when an iopub message last came or was handled
        # While the kernel's key changes (`KernelDriver.rekey`): its old one is good too.
        self.previous_auth: hmac.HMAC | None = None
        self.replied_with_previous_key: set[str] = set()
        self._tasks = [
            asyncio.ensure_future(self._keep_iopub()),
            asyncio.ensure_future(self._handle_iopub()),
            asyncio.ensure_future(self._read_shell(client.shell_channel.socket)),
            asyncio.ensure_future(self._drain(client.control_channel.socket)),
        ]

    def sent_on_shell(self) -> None:
        """Say a request went out on the shell socket: the reply's reader looks again now."""
        self._shell_sent.set()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for waiter in self.replies.values():
            waiter.cancel()
        self.client.stop_channels()  # destroys the client's context, and our sockets with it

    async def _parse(self, frames: list[Frame], *, reply: bool = False) -> KernelMessage:
        try:
            return await parse_off_loop(frames, self.client.session.auth)
        except Malformed as exc:
            if self.previous_auth is None or str(exc) != BAD_SIGNATURE:
                raise
            msg = await parse_off_loop(frames, self.previous_auth)
            if reply:  # the kernel answered with its old key: it did not take the new one
                self.replied_with_previous_key.add(msg.parent_id)
            return msg

    def follow(self, msg_id: str, on_output: OutputHandler | None) -> Watch:
        """From now on, hand this request's output to `on_output` (None: only track its end)."""
        self.watch = Watch(msg_id, on_output)
        return self.watch

    def reply_to(self, msg_id: str) -> asyncio.Future[dict[str, Any]]:
        """The content of the shell's reply to `msg_id`, when it comes."""
        waiter = self.replies.get(msg_id)
        if waiter is None:
            waiter = self.replies[msg_id] = asyncio.get_running_loop().create_future()
        return waiter

    def forget_reply(self, msg_id: str) -> None:
        waiter = self.replies.pop(msg_id, None)
        if waiter is not None:
            waiter.cancel()

    async def until_finished(
        self, watch: Watch, reply: asyncio.Future[dict[str, Any]], late_output: bool = False
    ) -> None:
        """Return once the request is over: its reply came and its idle status too, or iopub
        went quiet for a moment after the reply (the idle was dropped on the way: then
        `watch.end_unconfirmed` says so, once the message being handled is done).

        `late_output`: the kernel may publish output after its idle status (Deno's): a flush
        request (late_output.py) is sent at once, queued in the kernel behind this one, which
        it takes only once this one is over, idle status published. The flush's marker follows
        all of this request's output on iopub, so it alone ends the wait; without it, the
        same quiet rule as for a missing idle applies."""
        if late_output and watch.flush is None:
            watch.flush = send_flush(self.client)
            self.sent_on_shell()
        await asyncio.shield(reply)
        replied = time.monotonic()
        if watch.flush is None:
            most = MAX_WAIT_AFTER_REPLY_S
            if self.output_moved is not None:
                most = MAX_WAIT_AFTER_RELAYED_REPLY_S
            await self._until_event(watch, watch.idle, replied, QUIET_AFTER_REPLY_S, most)
            return
        await self._until_event(
            watch, watch.flush.marked, replied, QUIET_BEFORE_MARK_S, MAX_WAIT_FOR_MARK_S
        )

    async def _until_event(
        self, watch: Watch, event: asyncio.Event, since: float, quiet_s: float, most_s: float
    ) -> None:
        """Until `event`; or iopub quiet for `quiet_s` after `since`, or `most_s` after it (then
        the end is unconfirmed)."""
        limit = since + most_s
        while not event.is_set():
            now = time.monotonic()
            if self.inbox.items or self.handling:
                self.last_activity = now
            if self.output_moved is not None:
                self.last_activity = max(self.last_activity, self.output_moved())
            quiet_until = max(self.last_activity, since) + quiet_s
            wait = min(quiet_until, limit) - now
            if wait <= 0:
                watch.end_unconfirmed = True
                await self.handler_free.wait()  # a message half taken would change the run
                return
            wait = min(wait, 0.1)
            try:
                await asyncio.wait_for(event.wait(), wait)
            except TimeoutError:
                continue

    # ----------------------------------------------------------------------------------------

    def _count_malformed(self, why: str) -> None:
        log.debug("dropped a kernel message: %s", why)
        if self.watch is not None:
            self.watch.malformed += 1

    async def _keep_iopub(self) -> None:
        """Read iopub; when ZeroMQ drops the connection (a frame over the limit), start over on
        a new socket."""
        while True:
            socket = cast("zmq.asyncio.Socket", self.client.connect_iopub())
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            reader = asyncio.ensure_future(self._read_iopub(socket))
            try:
                await monitor.recv_multipart()  # the only event asked for: disconnected
                self._count_malformed("output connection reset: a message over the limit")
                # Not live again until a message is seen on the new socket: the next request
                # waits for that, so none of its output is published before we subscribe.
                self.iopub_seen.clear()
            finally:
                reader.cancel()
                if not socket.closed:  # else the context went first, with its sockets
                    socket.disable_monitor()
                    monitor.close(linger=0)
                    socket.close(linger=0)

    async def _read_iopub(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await receive_frames(socket, self.frame_limit)
            except zmq.ZMQError:  # closed with its kernel
                return
            self.iopub_seen.set()
            self.last_activity = time.monotonic()
            if frames is None:
                self._count_malformed(f"over {self.frame_limit} bytes")
            else:
                await self.inbox.put(frames)
            del frames  # not held while the next message is awaited

    async def _handle_iopub(self) -> None:
        while True:
            frames = await self.inbox.get()
            self.handling = True
            self.handler_free.clear()
            try:
                await self._handle_one(frames)
            finally:
                del frames  # not held while the next message is awaited
                self.handling = False
                self.handler_free.set()
                self.last_activity = time.monotonic()

    async def _handle_one(self, frames: list[Frame]) -> None:
        watch = self.watch
        if watch is None or not _wanted(watch, peek_parent_id(frames)):
            return  # nobody wants it (a background thread's output, a past run's): unread
        try:
            msg = await self._parse(frames)
        except Malformed as exc:
            self._count_malformed(str(exc))
            return
        watch = self.watch
        if watch is None or not _wanted(watch, msg.parent_id):
            return  # nobody wants it: output of a background thread, or of a past run
        watch.last_message = time.monotonic()
        try:
            flush = watch.flush
            if flush is not None and msg.parent_id == flush.msg_id:  # marker, or late output
                if msg.msg_type == MARK_TYPE:
                    content = await msg.text_content(STATUS_TEXT_CHARS)
                    if content.get("nonce") == flush.nonce:  # not one the call's code forged
                        flush.marked.set()
                elif msg.msg_type not in ("status", "execute_input", "error") and watch.on_output:
                    await watch.on_output(msg)
            elif msg.msg_type == "status":
                status = await msg.text_content(STATUS_TEXT_CHARS)
                if status.get("execution_state") == "idle":
                    watch.idle.set()
            elif watch.on_output is not None:
                await watch.on_output(msg)
        except Malformed as exc:
            self._count_malformed(str(exc))
        except Exception:  # whatever a message does to a handler, the reading goes on
            log.exception("could not handle a kernel message of type %r", msg.msg_type)
            watch.malformed += 1

    async def _read_shell(self, socket: zmq.asyncio.Socket) -> None:
        """Answer whoever waits for each reply. No message is held while the next one is
        awaited: a reply can be hundreds of megabytes."""
        while True:
            try:
                frames = await receive_frames(socket, self.frame_limit, self._shell_sent)
            except zmq.ZMQError:  # closed with its kernel
                return
            self.shell_received += 1
            try:
                await self._answer(frames)
            finally:
                del frames

    async def _answer(self, frames: list[Frame] | None) -> None:
        """Settle the wait for the request a shell message answers: unusable messages are
        counted, those nobody waits for dropped unread."""
        if frames is None:
            self._count_malformed(f"over {self.frame_limit} bytes")
            return
        parent_id = peek_parent_id(frames)
        if parent_id is None or parent_id not in self.replies:
            return
        try:
            msg = await self._parse(frames, reply=True)
        except Malformed as exc:
            self._count_malformed(str(exc))
            return
        waiter = self.replies.pop(msg.parent_id, None)
        if waiter is None or waiter.done():
            return
        try:
            content = await msg.text_content(self.text_limit)
        except Malformed as exc:
            self._count_malformed(str(exc))
            content = {"status": "error", "evalue": f"a malformed reply ({exc})"}
        if not waiter.done():  # it may have been given up while the reply was decoded
            waiter.set_result(content)

    async def _drain(self, socket: zmq.asyncio.Socket) -> None:
        """Control replies (to interrupts) are not needed: read them, unparsed, so they never
        queue."""
        while True:
            try:
                await receive_frames(socket, self.frame_limit)
            except zmq.ZMQError:  # closed with its kernel
                return


def _wanted(watch: Watch, parent_id: str | None) -> bool:
    """A message of the followed request, or of its flush until the flush's marker came."""
    if parent_id == watch.msg_id:
        return True
    flush = watch.flush
    return flush is not None and parent_id == flush.msg_id and not flush.marked.is_set()
