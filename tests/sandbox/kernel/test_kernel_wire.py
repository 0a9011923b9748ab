"""Kernel messages are taken apart without trusting them: anything wrong is `Malformed`."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from sandbox.kernel import wire
from sandbox.kernel.wire import DELIMITER, Frame, KernelMessage, Malformed, parse, peek_parent_id

pytestmark = pytest.mark.unit

KEY = b"k" * 32
AUTH = hmac.HMAC(KEY, digestmod=hashlib.sha256)


def signed(*parts: Frame) -> list[Frame]:
    check = AUTH.copy()
    for part in parts:
        check.update(part)
    return [b"topic", DELIMITER, check.hexdigest().encode(), *parts]


def test_a_message_the_kernel_would_send() -> None:
    session = Session(key=KEY)
    msg = session.msg("stream", {"name": "stdout", "text": "hi"}, parent={"msg_id": "m1"})
    parsed = parse([*session.serialize(msg, ident=b"stream")], AUTH)
    assert parsed == KernelMessage("stream", "m1", parsed.content_bytes)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"no delimiter"], "no delimiter"),
        ([DELIMITER, b"sig"], "frames after the delimiter"),
        ([DELIMITER, b"0" * 64, b"{}", b"{}", b"{}", b"{}"], "bad signature"),
        (signed(b"{nope", b"{}", b"{}", b"{}"), "not valid JSON"),
        (signed(b"[]", b"{}", b"{}", b"{}"), "not an object"),
        (signed(b"\xff", b"{}", b"{}", b"{}"), "not valid JSON"),
        (signed(b"[" * 60_000, b"{}", b"{}", b"{}"), "not valid JSON"),
        (signed(b"[" * 100_000, b"{}", b"{}", b"{}"), "a header of over"),
        (signed(b'{"msg_type": "x"}', b" " * 70_000, b"{}", b"{}"), "a header of over"),
        (signed(b'{"msg_type": 5}', b"{}", b"{}", b"{}"), "no msg_type"),
        (signed(b'{"msg_type": "x"}', b'{"msg_id": 1}', b"{}", b"{}"), "msg_id"),
    ],
)
def test_what_is_wrong_is_malformed(frames: list[Frame], why: str) -> None:
    with pytest.raises(Malformed, match=why):
        parse(frames, AUTH)


async def test_content_that_is_not_an_object_is_malformed() -> None:
    msg = parse(signed(b'{"msg_type": "stream"}', b"{}", b"{}", b'"text"'), AUTH)
    with pytest.raises(Malformed, match="not an object"):
        await msg.content()


def test_the_parent_is_peeked_without_trusting_anything() -> None:
    header, parent = b'{"msg_type": "stream"}', b'{"msg_id": "m-1"}'
    assert peek_parent_id(signed(header, parent, b"{}", b"{}")) == "m-1"
    assert peek_parent_id([DELIMITER, b"forged", header, parent, b"{}", b"{}"]) == "m-1"
    unreadable: list[list[Frame]] = [
        [b"no delimiter"],
        [DELIMITER, b"sig", header],
        [DELIMITER, b"sig", header, b"[1]", b"{}", b"{}"],
        [DELIMITER, b"sig", header, b'{"msg_id": 5}', b"{}", b"{}"],
        [DELIMITER, b"sig", header, b'{"msg_id": "' + b"x" * 70_000 + b'"}', b"{}", b"{}"],
    ]
    for frames in unreadable:
        assert peek_parent_id(frames) is None


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-be", "utf-8-sig"])
async def test_content_is_utf8_or_malformed_whichever_way_it_is_decoded(encoding: str) -> None:
    """Jupyter's messages are UTF-8. json.loads guesses UTF-16 or UTF-32 from bytes (and skips a
    BOM), which a view of a large frame never did: a content was taken or not by its size."""
    content = json.dumps({"name": "stdout", "text": "hi " * 1000}).encode(encoding)
    for frame in (content, memoryview(content)):
        msg = parse(signed(b'{"msg_type": "stream"}', b"{}", b"{}", frame), AUTH)
        with pytest.raises(Malformed, match=r"not valid JSON|does not decode"):
            await msg.content()
        with pytest.raises(Malformed, match=r"not valid JSON|does not decode"):
            await msg.text_content(10)


async def test_a_send_on_the_socket_makes_a_waiting_receive_look_again_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A send can consume the edge pyzmq's poll waits for (a Deno call's flush, sent right
    behind the call, held its reply for a whole recheck). Here the edge is consumed as a send
    does (the socket's events read while the reply is there), with no recheck in the test's
    lifetime: only the sender's word can end the wait, and it does."""
    monkeypatch.setattr(wire, "RECHECK_MS", 3_600_000)
    endpoint = f"ipc://{tmp_path}/shell"
    ours_context, theirs_context = zmq.asyncio.Context(), zmq.Context()
    ours, theirs = ours_context.socket(zmq.DEALER), theirs_context.socket(zmq.ROUTER)
    try:
        theirs.bind(endpoint)
        ours.connect(endpoint)
        sent = asyncio.Event()
        receiving = asyncio.ensure_future(wire.receive_frames(ours, 1 << 20, sent))
        await ours.send_multipart([b"request"])
        identity, request = await asyncio.to_thread(theirs.recv_multipart)
        assert request == b"request"
        await asyncio.sleep(0)  # the receive is polling
        theirs.send_multipart([identity, b"reply"])
        # The edge, taken as a send takes it: the socket's events read while the reply is
        # there, before the event loop looks at the descriptor again (no await in between).
        deadline = time.monotonic() + 30
        while not int(ours.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            assert time.monotonic() < deadline, "the reply never came"
            time.sleep(0.001)  # noqa: ASYNC251 - the loop must not run meanwhile
        for _ in range(10):  # the loop goes round: nothing wakes the poll
            await asyncio.sleep(0)
        assert not receiving.done()
        sent.set()  # what the sender does after each request
        assert await asyncio.wait_for(receiving, 30) == [b"reply"]
    finally:
        ours.close(linger=0)
        theirs.close(linger=0)
        ours_context.term()
        theirs_context.term()
