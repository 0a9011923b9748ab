"""A rich output far over what a run may still keep is left out unread, even when its bytes
mention an `e2b/` form: only one that could fit once its derived forms (each at most a few MiB,
as the kernel's start-up file caps them) are dropped is worth decoding."""

from __future__ import annotations

import pytest

from sandbox.kernel.collector import OutputCollector
from sandbox.kernel.wire import KernelMessage

pytestmark = pytest.mark.unit

# Far past the budget plus any derived forms the kernel would send (display_forms.py: 4 MiB each).
HUGE = 48 << 20


async def test_a_huge_output_naming_an_e2b_form_is_left_out_without_decoding() -> None:
    collector = OutputCollector(1000, None, result_limit_bytes=1000)
    # Cut off mid-string: decoding it would raise Malformed; leaving it out unread does not.
    content = b'{"data": {"e2b/data": {}, "text/plain": "' + b"x" * HUGE
    await collector.take(KernelMessage("display_data", "parent", content))
    (kept,) = collector.results
    assert kept.text is not None and "was left out" in kept.text
    assert collector.results_too_big == 1
