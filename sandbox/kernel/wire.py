"""Kernel messages off the wire, taken apart without trusting them.

The sandboxed code holds the kernel's HMAC key, so anything may arrive on our sockets: forged or
replayed messages, any JSON or none. jupyter_client's `Session.deserialize` raises on much of it
and decodes every byte on the event loop; here a message is read within a byte bound, its
signature checked and its small frames decoded, and its content is decoded only when someone
wants it, in a worker thread when it is large. A large frame is never copied out of ZeroMQ's
buffer (a memoryview of it), and a text that the output limit cuts anyway is cut before it is
decoded (see long_text). Whatever is wrong yields a reason, never an exception. (A replay is not
refused: whoever can replay can also sign anything.)
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from sandbox.kernel.long_text import restore, shorten

DELIMITER = b"<IDS|MSG>"
# Content up to this size is decoded on the event loop; larger content in a worker thread, so
# that its signature check (which releases the GIL) and decoding do not stall other sessions.
INLINE_DECODE_BYTES = 256 << 10
# How long a wait for a message goes before it looks at the socket again (see receive_frames).
RECHECK_MS = 250
# A header or parent header is a few hundred bytes; one far larger is not looked into.
MAX_PARENT_HEADER_BYTES = 64 << 10
# Frames larger than this stay in ZeroMQ's buffer, seen through a memoryview, rather than copied.
ZERO_COPY_BYTES = 64 << 10

# A frame as received: small ones copied out, large ones a view of ZeroMQ's buffer.
Frame = bytes | memoryview


BAD_SIGNATURE = "bad signature"


class Malformed(Exception):
    """A kernel message we cannot use; its text says why."""


@dataclass(frozen=True)
class KernelMessage:
    """A signed kernel message whose header and parent were decoded; its content not yet."""

    msg_type: str
    parent_id: str
    content_bytes: Frame

    @property
    def content_size(self) -> int:
        return len(self.content_bytes)

    async def content(self) -> dict[str, Any]:
        """The decoded content: a dict, or `Malformed`."""
        if self.content_size > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(decode_object, self.content_bytes, "content")
        return decode_object(self.content_bytes, "content")

    async def text_content(self, keep_chars: int) -> dict[str, Any]:
        """The decoded content of a message whose texts are only ever kept up to `keep_chars`
        characters (streams, errors, replies, statuses): a text of over twice that many bytes
        is cut to its first and last `keep_chars` characters before decoding (a `CutText`),
        never decoded whole, and those between the message's first and last few to their
        count (see long_text). A dict, or `Malformed`."""
        if self.content_size <= 2 * keep_chars:  # no text in it can be cut
            return await self.content()
        return await asyncio.to_thread(decode_text_object, self.content_bytes, keep_chars)


async def receive_frames(
    socket: zmq.asyncio.Socket, max_bytes: int, sent: asyncio.Event | None = None
) -> list[Frame] | None:
    """One multipart message; None when its frames add up to more than `max_bytes`.

    (Each frame is already bounded by ZeroMQ's `MAXMSGSIZE`; this bounds their sum.) A large
    frame is not copied: copying a 200 MB frame would hold the event loop and, for a moment,
    hold it twice. `sent`: set by whoever sends on this socket (see `_readable`).
    """
    while not await _readable(socket, sent):
        pass
    parts = await socket.recv_multipart(copy=False)
    if sum(len(part) for part in parts) > max_bytes:
        return None
    return [part.buffer if len(part) > ZERO_COPY_BYTES else part.bytes for part in parts]


async def _readable(socket: zmq.asyncio.Socket, sent: asyncio.Event | None) -> bool:
    """Whether a message waits on the socket, looked at again after at most one recheck.

    pyzmq wakes a waiting poll on an edge of the socket's descriptor, and a send on the same
    socket (our requests on shell) can consume that edge: the poll would then sleep beside a
    message that has arrived. A poll that times out looks at the socket's events afresh, and
    never takes a message, so nothing waits longer than one recheck; and a send (`sent`, set by
    the sender) ends the poll at once, so the next one looks afresh: a Deno call, which sends its
    flush right behind the call, waited a whole recheck (250 ms) for its reply once in 20-75.
    """
    if sent is None:
        return bool(await socket.poll(RECHECK_MS))  # POLLIN, by default
    sent.clear()
    polling = asyncio.ensure_future(socket.poll(RECHECK_MS))
    kicked = asyncio.ensure_future(sent.wait())
    try:
        await asyncio.wait({polling, kicked}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        polling.cancel()  # a poll never takes a message: dropping one loses nothing
        kicked.cancel()
    return polling.done() and not polling.cancelled() and bool(polling.result())


def parse(frames: list[Frame], auth: hmac.HMAC | None) -> KernelMessage:
    """Check a message's framing and signature and decode its header; raise `Malformed`."""
    try:
        start = frames.index(DELIMITER) + 1
    except ValueError:
        raise Malformed("no delimiter frame") from None
    parts = frames[start:]
    if len(parts) < 5:
        raise Malformed(f"{len(parts)} frames after the delimiter, not at least 5")
    signature, header_bytes, parent_bytes, metadata, content = parts[:5]
    if auth is not None:
        check = auth.copy()
        for part in (header_bytes, parent_bytes, metadata, content):
            check.update(part)
        if not hmac.compare_digest(check.hexdigest().encode(), bytes(signature)):
            raise Malformed(BAD_SIGNATURE)
    if max(len(header_bytes), len(parent_bytes)) > MAX_PARENT_HEADER_BYTES:
        raise Malformed(f"a header of over {MAX_PARENT_HEADER_BYTES} bytes")
    header = decode_object(header_bytes, "header")
    parent = decode_object(parent_bytes, "parent header")
    msg_type = header.get("msg_type")
    if not isinstance(msg_type, str):
        raise Malformed("the header has no msg_type string")
    parent_id = parent.get("msg_id", "")
    if not isinstance(parent_id, str):
        raise Malformed("the parent header's msg_id is not a string")
    return KernelMessage(msg_type, parent_id, content)


def peek_parent_id(frames: list[Frame]) -> str | None:
    """The msg_id a message answers, read from its (small) parent header alone and unchecked:
    enough to drop, unread, what nobody waits for. None: it has no readable parent header."""
    try:
        parent_bytes = frames[frames.index(DELIMITER) + 3]
    except (ValueError, IndexError):
        return None
    if len(parent_bytes) > MAX_PARENT_HEADER_BYTES:
        return None
    try:
        parent_id = decode_object(parent_bytes, "parent header").get("msg_id")
    except Malformed:
        return None
    return parent_id if isinstance(parent_id, str) else None


async def parse_off_loop(frames: list[Frame], auth: hmac.HMAC | None) -> KernelMessage:
    """`parse`, in a worker thread when the message is large (its signature covers it all)."""
    if sum(len(f) for f in frames) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(parse, frames, auth)
    return parse(frames, auth)


def decode_text_object(data: Frame, keep_chars: int) -> dict[str, Any]:
    """`decode_object` of content whose long texts are cut first (see `long_text`)."""
    try:
        shortened, cuts = shorten(data, keep_chars)
    except ValueError as exc:
        raise Malformed(f"the content does not decode: {exc}") from None
    value = decode_object(shortened, "content")
    restore(value, cuts)
    return value


def decode_object(data: Frame, what: str) -> dict[str, Any]:
    """`data` as a JSON object, or `Malformed`. Always UTF-8 (Jupyter's wire format; json.loads
    would guess UTF-16 or UTF-32 from bytes), encoded surrogates let through as json.loads lets
    them: as `long_text` decodes the texts it cuts."""
    try:
        value = json.loads(str(data, "utf-8", "surrogatepass"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Malformed(f"the {what} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise Malformed(f"the {what} is a JSON {type(value).__name__}, not an object")
    return value
