"""Long texts in kernel messages are cut before decoding, exactly as decoding them whole and then
keeping their head and tail would: same head, same tail, the same count of characters between,
whatever the escapes, multi-byte characters and surrogate pairs, and wherever a chunk ends; what
decoding whole refuses (invalid UTF-8, raw control characters, bad escapes) is refused too, never
looped on. Many long texts are cut harder (their middle ones to a count), never refused, and the
decoded document stays within a small multiple of what is kept. A document of too many values
is refused, not built."""

from __future__ import annotations

import json
import random
import tracemalloc
from typing import Any

import pytest

import sandbox.kernel.long_text as long_text
from sandbox.kernel.collector import OutputCollector
from sandbox.kernel.long_text import CutText, restore, shorten
from sandbox.kernel.wire import KernelMessage, Malformed, decode_object, decode_text_object

pytestmark = pytest.mark.unit

# Characters whose JSON forms differ in length: escapes, 2-, 3- and 4-byte UTF-8, an escaped
# surrogate pair (ensure_ascii), a lone surrogate, control characters, escaped backslashes.
ALPHABET = ["a", '"', "\\", "\n", "é", "😀", "Ā", "/", "\x01", "\ud800", '\\\\"', "x" * 5]


def decoded_both_ways(document: Any, keep: int, ensure_ascii: bool) -> tuple[Any, Any]:
    data = json.dumps(document, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    shortened, cuts = shorten(data, keep)
    value = json.loads(bytes(shortened))
    restore(value, cuts)
    return value, json.loads(data)


def assert_same_but_cut(value: Any, whole: Any, keep: int) -> None:
    if isinstance(whole, dict):
        assert isinstance(value, dict) and len(value) == len(whole)
        for got, expected in zip(value.items(), whole.items(), strict=True):
            assert_same_but_cut(list(got), list(expected), keep)  # keys are cut alike
    elif isinstance(whole, list):
        assert isinstance(value, list) and len(value) == len(whole)
        for got, expected in zip(value, whole, strict=True):
            assert_same_but_cut(got, expected, keep)
    elif isinstance(value, CutText):  # its head and tail (none in a document's middle)
        assert (len(value.head), len(value.tail)) in ((keep, keep), (0, 0))
        assert value.head == whole[: len(value.head)]
        assert value.tail == whole[len(whole) - len(value.tail) :]
        assert len(value.head) + value.dropped + len(value.tail) == len(whole)
    else:
        assert value == whole


@pytest.mark.parametrize("short_bytes", [0, 64])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 48, 1 << 20])
def test_cutting_before_decoding_keeps_what_decoding_whole_keeps(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, short_bytes: int
) -> None:
    monkeypatch.setattr(long_text, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(long_text, "SHORT_LITERAL_BYTES", short_bytes)
    rng = random.Random(chunk_bytes)
    cut = counted = 0
    for _ in range(800):
        keep = rng.randint(1, 20)

        def text(most: int) -> str:
            return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, most)))

        document = {"name": "stdout", "text": text(120), "lines": [text(40) for _ in range(5)]}
        for ensure_ascii in (True, False):
            value, whole = decoded_both_ways(document, keep, ensure_ascii)
            assert_same_but_cut(value, whole, keep)
            cut += isinstance(list(value.values())[1], CutText)
            lines = value.get("lines", [])  # its key too may be cut, when every string is
            counted += sum(isinstance(t, CutText) and not t.head for t in lines)
    assert cut > 100  # the cut path was taken, not only the whole one
    assert counted > 100  # and strings in the middle were cut to their count


def test_a_huge_text_is_cut_with_an_exact_count() -> None:
    value = "head" + "v" * 20_000_000 + "tail"
    data = json.dumps({"ename": "ValueError", "evalue": value}).encode()
    shortened, cuts = shorten(data, 1000)
    assert len(shortened) < 200
    decoded = json.loads(bytes(shortened))
    restore(decoded, cuts)
    kept = decoded["evalue"]
    assert isinstance(kept, CutText) and decoded["ename"] == "ValueError"
    assert kept.head == "head" + "v" * 996 and kept.tail == "v" * 996 + "tail"
    assert kept.dropped == len(value) - 2000


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b"[" + b'"a",' * 100_001 + b'"a"]', "strings"),
        (b"[" + b"[]," * 1_000_000 + b"[]]", "outside strings"),
        (b'{"text": "' + b"x" * 100, "never closed"),
    ],
    ids=["too-many-strings", "millions-of-lists", "unclosed"],
)
def test_a_document_of_too_many_values_is_refused(document: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        shorten(document, 1000)


async def test_a_cut_message_is_kept_with_the_true_count_of_what_was_dropped() -> None:
    """From the wire to the execution: the marker counts every character that never arrived."""
    collector = OutputCollector(1000, None)
    text = "a" * 5_000_000 + "é" * 5_000_000 + "z"
    content = json.dumps({"name": "stdout", "text": text}, ensure_ascii=False).encode()
    await collector.take(KernelMessage("stream", "parent", memoryview(content)))
    error = {"ename": "E", "evalue": "v" * 5_000_000, "traceback": ["first", "x" * 5_000_000]}
    await collector.take(KernelMessage("error", "parent", json.dumps(error).encode()))
    execution = collector.build(status="ok", duration_s=0.0)
    assert execution.stdout.startswith("a" * 500) and execution.stdout.endswith("é" * 499 + "z")
    assert execution.stdout_dropped == len(text) - 1000
    assert f"[... {len(text) - 1000} characters of stdout dropped" in execution.stdout
    assert execution.error is not None
    assert f"[... {5_000_000 - 1000} characters of the error value dropped" in execution.error.value
    assert execution.error.traceback.startswith("first\nxxx")
    assert (
        f"[... {5_000_006 - 1000} characters of the traceback dropped" in execution.error.traceback
    )


async def test_a_text_message_too_big_to_decode_is_malformed() -> None:
    content = b'{"name": "stdout", "text": [' + b"[]," * 1_000_000 + b"[]]}"
    with pytest.raises(Malformed, match="outside strings"):
        await KernelMessage("stream", "parent", content).text_content(1000)


# What the kernel sends for `print('\udc80' * n)`: jupyter_client encodes with surrogateescape,
# so each lone surrogate becomes a raw continuation byte. A chunk made only of them once sent
# the chunked decoder into an endless loop (a worker thread spinning, the execute never answered).
INVALID_UTF8 = {
    "continuation-bytes": lambda n: b"\x80" * n,
    "after-text": lambda n: b"a" * n + b"\xbf" * 10,
    "lead-byte-alone": lambda n: b"a" * n + b"\xe9" + b"a" * n,
    "cut-at-the-end": lambda n: b"a" * n + "😀".encode()[:3],
    "overlong": lambda n: b"a" * n + b"\xc0\xaf",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk_bytes", [7, 1 << 20])
@pytest.mark.parametrize("kind", list(INVALID_UTF8))
def test_invalid_utf8_is_refused_as_decoding_whole_refuses_it(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, kind: str
) -> None:
    monkeypatch.setattr(long_text, "CHUNK_BYTES", chunk_bytes)
    body = INVALID_UTF8[kind](300 if chunk_bytes < 1 << 20 else 3_000_000)
    content = b'{"name": "stdout", "text": "' + body + b'"}'
    with pytest.raises(Malformed, match="not valid JSON"):
        decode_object(content, "content")
    with pytest.raises(Malformed, match="not UTF-8"):
        decode_text_object(memoryview(content), 10)


@pytest.mark.parametrize("chunk_bytes", [1, 5, 1 << 20])
def test_cut_and_whole_refuse_the_same_documents(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """Whatever breaks a document (a raw control character, a bad escape, invalid UTF-8 of any
    kind, a stray quote or backslash) breaks it for both ways of decoding, or for neither."""
    monkeypatch.setattr(long_text, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(long_text, "SHORT_LITERAL_BYTES", 4)
    breakers = [b"\x80", b"\xff", b"\xe9", b"\xed\xa0\x80", b"\xf0\x9f", b"\x01", b"\x1f"]
    breakers += [b"\\x", b"\\u12", b"\\ud83d", b"\\ude00", b'"', b"\\", b"\x7f", b"\\/"]
    rng = random.Random(chunk_bytes)
    refused = 0
    for _ in range(1500):
        keep = rng.randint(1, 8)
        texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30))) for _ in "abc"]
        data = json.dumps({"text": texts}, ensure_ascii=rng.random() < 0.5)
        content = bytearray(data.encode("utf-8", "surrogatepass"))
        for _ in range(rng.randint(1, 2)):
            at = rng.randint(len(b'{"text": ["'), len(content) - 3)
            content[at:at] = rng.choice(breakers)
        try:
            whole: Any = decode_object(bytes(content), "content")
        except Malformed:
            whole = None
        try:
            cut: Any = decode_text_object(memoryview(bytes(content)), keep)
        except Malformed:
            cut = None
        assert (whole is None) == (cut is None), bytes(content)
        if whole is None:
            refused += 1
        else:
            assert_same_but_cut(cut, whole, keep)
    assert 100 < refused < 1400  # both outcomes were tried


@pytest.mark.timeout(60)
def test_a_chunk_of_control_characters_is_refused_as_decoding_whole_refuses_it() -> None:
    content = b'{"name": "stdout", "text": "' + b"a\x01" * 2_000_000 + b'"}'
    with pytest.raises(Malformed):
        decode_object(content, "content")
    with pytest.raises(Malformed, match="control character"):
        decode_text_object(memoryview(content), 1000)


def test_many_medium_texts_decode_within_a_small_multiple_of_what_is_kept() -> None:
    """31 traceback lines of 2 MB, each under twice what is kept, each with a character outside
    the BMP (four bytes a character once decoded): decoded whole they were ~250 MB held and a
    ~500 MB peak for a 62 MB message. Now only the lines near either end are decoded whole."""
    keep = 1_000_000
    line = "😀" + "a" * (2 * keep - 10)
    error = {"traceback": [f"{i}{line}" for i in range(31)], "ename": "E", "evalue": "x"}
    content = memoryview(json.dumps(error, ensure_ascii=False).encode())
    tracemalloc.start()
    try:
        value = decode_text_object(content, keep)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # At most 2 * (REGION_KEEPS + 2) * keep characters decoded, at 4 bytes each: 40 MB.
    assert peak < 4 * 2 * (long_text.REGION_KEEPS + 2) * keep + (16 << 20), f"{peak >> 20} MiB"
    lines = value["traceback"]
    assert lines[0] == f"0{line}" and lines[-1] == f"30{line}" and value["evalue"] == "x"
    middle = [i for i, text in enumerate(lines) if isinstance(text, CutText)]
    assert len(middle) > 20
    for i in middle:
        assert lines[i].head == lines[i].tail == "" and lines[i].dropped == len(f"{i}{line}")


async def test_many_long_texts_are_cut_harder_never_refused() -> None:
    """An error value and 16 traceback lines of 3 MB each: once refused whole as "too big to
    decode" (so the user saw a malformed reply instead of their exception)."""
    keep = 1_000_000
    lines = [f"line {i} " + "v" * 3_000_000 + f" end {i}" for i in range(16)]
    error = {"traceback": lines, "ename": "Loud", "evalue": "value " + "v" * 3_000_000 + " end"}
    collector = OutputCollector(keep, None)
    await collector.take(KernelMessage("error", "parent", memoryview(json.dumps(error).encode())))
    execution = collector.build(status="error", duration_s=0.0)
    assert collector.malformed_messages == 0 and execution.error is not None
    assert execution.error.name == "Loud"
    assert execution.error.value.startswith("value vvv") and execution.error.value.endswith(" end")
    assert execution.error.traceback.startswith("line 0 vvv")
    assert execution.error.traceback.endswith("vvv end 15")
    dropped = len("\n".join(lines)) - keep
    assert f"[... {dropped} characters of the traceback dropped" in execution.error.traceback
