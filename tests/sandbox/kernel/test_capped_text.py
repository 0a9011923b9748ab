"""Output kept within a cap: its head and its tail, with a marker saying how much of the middle
went, however the text arrives and with memory bounded by the cap."""

from __future__ import annotations

import random
import string

import pytest

from sandbox.kernel.collector import CappedText, capped

pytestmark = pytest.mark.unit


def marker(name: str, dropped: int, head: int, tail: int) -> str:
    return (
        f"\n[... {dropped} characters of {name} dropped: the output limit keeps the first {head} "
        f"and the last {tail} ...]\n"
    )


def expected(text: str, limit: int, name: str = "stdout") -> tuple[str, int]:
    """What the cap keeps, computed from the whole text at once."""
    if len(text) <= limit:
        return text, 0
    head, tail = limit // 2, limit - limit // 2
    dropped = len(text) - limit
    return text[:head] + marker(name, dropped, head, tail) + text[len(text) - tail :], dropped


def fed(chunks: list[str], limit: int, name: str = "stdout") -> CappedText:
    kept = CappedText(name, limit)
    for chunk in chunks:
        kept.append(chunk)
    return kept


def test_text_within_the_limit_is_kept_whole() -> None:
    assert fed(["hello ", "world"], 11).value() == ("hello world", 0)


def test_nothing_appended_is_empty() -> None:
    assert CappedText("stdout", 10).value() == ("", 0)


def test_one_character_over_drops_one_from_the_middle() -> None:
    kept = fed(["0123456789X"], 10)
    assert kept.value() == ("01234" + marker("stdout", 1, 5, 5) + "6789X", 1)


def test_an_odd_limit_gives_the_extra_character_to_the_tail() -> None:
    kept = fed(["abcdefghijklmnop"], 7, name="stderr")
    assert kept.value() == ("abc" + marker("stderr", 9, 3, 4) + "mnop", 9)


def test_a_limit_of_zero_keeps_only_the_marker() -> None:
    assert fed(["abc", "de"], 0).value() == (marker("stdout", 5, 0, 0), 5)


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_keeps_the_same_head_and_tail(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choices(string.ascii_letters + "\n é", k=rng.randrange(0, 3000)))
    limit = rng.randrange(0, 400)
    chunks, at = [], 0
    while at < len(text):
        step = rng.choice([1, 2, 7, 50, 333, 2000])
        chunks.append(text[at : at + step])
        at += step
    if rng.random() < 0.3:
        chunks.insert(rng.randrange(len(chunks) + 1), "")  # an empty write changes nothing
    assert fed(chunks, limit).value() == expected(text, limit)


def test_a_flood_in_small_writes_keeps_memory_within_twice_the_cap() -> None:
    kept = CappedText("stdout", 1000)
    for i in range(200_000):
        kept.append(f"{i % 10}")
        assert len(kept.tail) <= 2 * kept.tail_limit
    assert kept.head_len == 500
    text, dropped = kept.value()
    assert dropped == 200_000 - 1000
    assert text.startswith("0123456789" * 50)
    assert text.endswith("0123456789" * 50)


def test_one_huge_write_is_trimmed_at_once() -> None:
    kept = CappedText("stdout", 100)
    kept.append("x" * 1_000_000)
    assert len(kept.tail) <= 2 * kept.tail_limit
    assert kept.value()[1] == 1_000_000 - 100


def test_value_can_be_read_more_than_once_and_between_writes() -> None:
    kept = fed(["a" * 30], 20)
    first = kept.value()
    assert kept.value() == first
    kept.append("b" * 30)
    assert kept.value() == expected("a" * 30 + "b" * 30, 20)


def test_capped_returns_short_text_itself() -> None:
    text = "short"
    assert capped(text, 5, "the name") is text


def test_capped_cuts_long_text_and_names_what_was_cut() -> None:
    assert (
        capped("N" * 600 + "V" * 600, 1000, "the error value")
        == expected("N" * 600 + "V" * 600, 1000, "the error value")[0]
    )
    assert "characters of the error value dropped" in capped("x" * 11, 10, "the error value")
