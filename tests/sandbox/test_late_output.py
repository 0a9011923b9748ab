"""A kernel that publishes a call's output after its idle status (Deno's) loses none of it and
lends none of it to the next call (sandbox/kernel/late_output.py).

Deno's kernel publishes the REPL thread's output from a queue of its own, under whichever
request is current when it gets to it: a long burst of `console.log` is still being published
well after the call's idle status, and, once the next request has begun, under that one's id.
Each case below runs the same way on every backend (Docker: the full image).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from tests.sandbox.polyglot import polyglot_sandbox

pytestmark = pytest.mark.timeout(600)

LANGUAGES = ("javascript", "typescript")
# Enough separate messages that publishing them takes far longer than any fixed wait after the
# idle status would (a few thousand a second through the relay), and well under the output cap;
# not many more: Deno's kernel keeps about 7 kB per printed line for good (deno 2.9.8).
LINES = 10_000


@pytest.fixture(scope="module")
async def deno(backend: Backend) -> AsyncIterator[Sandbox]:
    async with polyglot_sandbox(backend, LANGUAGES) as sb:
        yield sb


@pytest.mark.parametrize("language", LANGUAGES)
async def test_a_burst_of_prints_stays_whole_and_out_of_the_next_call(
    deno: Sandbox, language: str
) -> None:
    burst = f"for (let i = 0; i < {LINES}; i++) console.log('line', i)"
    printed = await deno.execute(burst, language=language, timeout_s=120)
    assert printed.status is ExecutionStatus.OK, printed
    assert printed.notice is None, printed.notice
    lines = printed.stdout.splitlines()
    assert len(lines) == LINES, f"{LINES - len(lines)} lines were lost"
    assert lines == [f"line {i}" for i in range(LINES)]
    # Sent at once: a line published late would land here, under this call's id.
    after = await deno.execute("console.log('next'); 5", language=language)
    assert after.stdout == "next\n", after.stdout[:200]
    assert [r.text for r in after.results] == ["5"]


@pytest.mark.parametrize("language", LANGUAGES)
async def test_every_call_gets_its_own_result_and_prints(deno: Sandbox, language: str) -> None:
    """The result of a short call is often published just after its idle status."""
    for i in range(30):
        done = await deno.execute(f"console.log('call {i}'); {i} * 2", language=language)
        assert done.stdout == f"call {i}\n", done
        assert [r.text for r in done.results] == [str(i * 2)], done


@pytest.mark.parametrize("language", LANGUAGES)
async def test_output_of_awaited_timers_and_an_error_after_prints_is_kept(
    deno: Sandbox, language: str
) -> None:
    timed = await deno.execute(
        "await new Promise((r) => setTimeout(() => { console.log('tick'); r(0); }, 20));\n"
        "for (let i = 0; i < 500; i++) console.log('after', i);\n"
        "await new Promise((r) => setTimeout(r, 10));\n"
        "7",
        language=language,
    )
    assert timed.status is ExecutionStatus.OK, timed
    assert timed.stdout.splitlines() == ["tick", *(f"after {i}" for i in range(500))]
    assert [r.text for r in timed.results] == ["7"]
    failed = await deno.execute(
        "for (let i = 0; i < 500; i++) console.log('before', i);\nthrow new Error('boom')",
        language=language,
    )
    assert failed.status is ExecutionStatus.ERROR, failed
    assert failed.error is not None and "boom" in failed.error.value
    assert failed.stdout.splitlines() == [f"before {i}" for i in range(500)]
    clean = await deno.execute("console.log('clean')", language=language)
    assert clean.stdout == "clean\n" and clean.error is None, clean


async def test_code_that_breaks_the_marker_still_ends_each_call(deno: Sandbox) -> None:
    """Without `Deno.jupyter.broadcast` no marker can come: a call then ends by the bounded
    quiet rule, says its end is unconfirmed, and puts back what it broke."""
    broken = await deno.execute(
        "globalThis.savedBroadcast = Deno.jupyter.broadcast;\n"
        "Deno.jupyter.broadcast = () => {};\n"
        "console.log('broken')",
        language="javascript",
    )
    assert broken.stdout == "broken\n", broken
    assert broken.notice is not None and "end-of-output" in broken.notice, broken
    started = time.monotonic()
    mended = await deno.execute(
        "Deno.jupyter.broadcast = globalThis.savedBroadcast; console.log('mended')",
        language="javascript",
    )
    assert time.monotonic() - started < 15.0
    assert mended.stdout == "mended\n", mended
    fine = await deno.execute("console.log('fine'); 1", language="javascript")
    assert fine.notice is None, fine
    assert fine.stdout == "fine\n" and [r.text for r in fine.results] == ["1"]


async def test_a_forged_marker_does_not_end_the_call(deno: Sandbox) -> None:
    """The call's code may broadcast the marker's type itself: without its flush's nonce it is
    not the marker, and what the call prints after it is still the call's."""
    forged = (
        'Deno.jupyter.broadcast("cir_output_flushed", {nonce: "guessed"});\n'
        "for (let i = 0; i < 2000; i++) console.log('after', i)"
    )
    done = await deno.execute(forged, language="javascript", timeout_s=120)
    assert done.status is ExecutionStatus.OK, done
    assert done.notice is None, done.notice
    assert done.stdout.splitlines() == [f"after {i}" for i in range(2000)]
    after = await deno.execute("console.log('next')", language="javascript")
    assert after.stdout == "next\n", after.stdout[:200]
