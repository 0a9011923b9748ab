"""Kernel messages are taken apart without trusting them: anything wrong is `Malformed`."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from jupyter_client.session import Session

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
