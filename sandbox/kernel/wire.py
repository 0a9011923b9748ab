"""Kernel messages off the wire, taken apart without trusting them.

The sandboxed code holds the kernel's HMAC key, so anything may arrive on our sockets: forged or
replayed messages, any JSON or none. jupyter_client's `Session.deserialize` raises on much of it
and decodes every byte on the event loop; here a message is read within a byte bound, its
signature checked and its small frames decoded, and its content is decoded only when someone
wants it, in a worker thread when it is large. Whatever is wrong yields a reason, never an
exception. (A replay is not refused: whoever can replay can also sign anything.)
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

DELIMITER = b"<IDS|MSG>"
# Content up to this size is decoded on the event loop; larger content in a worker thread, so
# that its signature check (which releases the GIL) and decoding do not stall other sessions.
INLINE_DECODE_BYTES = 256 << 10
# How long a wait for a message goes before it looks at the socket again (see receive_frames).
RECHECK_MS = 250
# A parent header is a few hundred bytes; one far larger is not looked into.
MAX_PARENT_HEADER_BYTES = 64 << 10


class Malformed(Exception):
    """A kernel message we cannot use; its text says why."""


@dataclass(frozen=True)
class KernelMessage:
    """A signed kernel message whose header and parent were decoded; its content not yet."""

    msg_type: str
    parent_id: str
    content_bytes: bytes

    @property
    def content_size(self) -> int:
        return len(self.content_bytes)

    async def content(self) -> dict[str, Any]:
        """The decoded content: a dict, or `Malformed`."""
        if self.content_size > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(decode_object, self.content_bytes, "content")
        return decode_object(self.content_bytes, "content")


async def receive_frames(socket: zmq.asyncio.Socket, max_bytes: int) -> list[bytes] | None:
    """One multipart message; None when its frames add up to more than `max_bytes`.

    (Each frame is already bounded by ZeroMQ's `MAXMSGSIZE`; this bounds their sum.)
    """
    # pyzmq wakes a waiting receive on an edge of the socket's descriptor, and a send on the
    # same socket (our requests on shell) can consume that edge: a receive could then sleep
    # beside a message that has arrived. A poll that times out looks at the socket's events
    # afresh, and never takes a message, so nothing waits longer than one recheck.
    while not await socket.poll(RECHECK_MS):  # POLLIN, by default
        pass
    frames: list[bytes] = await socket.recv_multipart()
    return frames if sum(len(f) for f in frames) <= max_bytes else None


def parse(frames: list[bytes], auth: hmac.HMAC | None) -> KernelMessage:
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
        if not hmac.compare_digest(check.hexdigest().encode(), signature):
            raise Malformed("bad signature")
    header = decode_object(header_bytes, "header")
    parent = decode_object(parent_bytes, "parent header")
    msg_type = header.get("msg_type")
    if not isinstance(msg_type, str):
        raise Malformed("the header has no msg_type string")
    parent_id = parent.get("msg_id", "")
    if not isinstance(parent_id, str):
        raise Malformed("the parent header's msg_id is not a string")
    return KernelMessage(msg_type, parent_id, content)


def peek_parent_id(frames: list[bytes]) -> str | None:
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


async def parse_off_loop(frames: list[bytes], auth: hmac.HMAC | None) -> KernelMessage:
    """`parse`, in a worker thread when the message is large (its signature covers it all)."""
    if sum(len(f) for f in frames) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(parse, frames, auth)
    return parse(frames, auth)


def decode_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Malformed(f"the {what} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise Malformed(f"the {what} is a JSON {type(value).__name__}, not an object")
    return value
