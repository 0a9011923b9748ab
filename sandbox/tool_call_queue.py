"""Host tool calls kept for a service that takes them with a long poll and answers each later:
the queue behind the cluster's relay on a sandbox's node (backends/ray_cluster/node_tool_relay.py)
and behind a wasm sandbox's calls (backends/wasm/), which reach the service as messages rather
than on a socket it listens on.

Bounded in memory: at most `MAX_UNANSWERED` calls (queued or taken, not answered yet), each
within the manifest's call size; past the cap a call is answered at once with a `busy` error.
The caller never waits forever: a call nobody takes within its tool's time limit is answered
with a `timeout` error here, as is one taken and not answered within `ANSWER_GRACE_S` past that
limit (whoever took it is gone). An answer over the manifest's result cap becomes a `too_large`
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from code_interpreter_wire.errors import SandboxClosed, SandboxError
from sandbox.frames import CallId, error_frame, parse_call

MAX_UNANSWERED = 64  # calls of one session queued or taken and not answered yet
CALLS_PER_POLL = 16  # at most this many calls in one answer of `next_calls`...
BYTES_PER_POLL = 4 << 20  # ...and this many bytes (one call is always given, whatever its size)
MAX_POLL_S = 30.0  # the longest a poll waits: a replica gone leaves no call waiting long
ANSWER_GRACE_S = 2.0  # past its time limit, a call taken has this long to be answered
MAX_MANIFEST_BYTES = 4 << 20
# Until the service gives the manifest: ChannelLimits' defaults.
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_MAX_CALL_BYTES = 1 << 20
DEFAULT_MAX_RESULT_BYTES = 8 << 20

# How a call's answer frame goes back to whoever made the call, within FRAME_TIMEOUT_S.
Deliver = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True)
class RelayLimits:
    """What the manifest says the calls may take: size caps and time limits."""

    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    max_call_bytes: int = DEFAULT_MAX_CALL_BYTES
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    tool_timeouts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: bytes) -> RelayLimits:
        """The limits of a manifest written by `ToolChannel.manifest()`; SandboxError if it
        is not one."""
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise SandboxError(
                f"the host-tool manifest is {len(manifest)} bytes, over {MAX_MANIFEST_BYTES}"
            )
        try:
            body = json.loads(manifest)
            timeout = float(body["timeout_s"])
            call_bytes = int(body["max_call_bytes"])
            result_bytes = int(body["max_result_bytes"])
            tools = {str(t["name"]): float(t["timeout_s"] or timeout) for t in body["tools"]}
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise SandboxError(f"not a host-tool manifest: {exc!r}") from None
        if min(timeout, *tools.values()) <= 0 or call_bytes <= 0 or result_bytes <= 0:
            raise SandboxError("a host-tool manifest with a limit that is not positive")
        return cls(timeout, call_bytes, result_bytes, tools)

    def timeout_of(self, tool: str) -> float:
        return self.tool_timeouts.get(tool, self.call_timeout_s)


@dataclass
class _Call:
    key: str
    body: bytes
    call_id: CallId
    tool: str
    deliver: Deliver
    group: set[str]  # the keys of the calls that came the same way (a connection)
    taken: bool = False
    timer: asyncio.TimerHandle | None = None


class ToolCallQueue:
    """One sandbox's calls: those not taken yet, oldest first, and those taken, until answered."""

    def __init__(self) -> None:
        self.limits = RelayLimits()
        self._unanswered: dict[str, _Call] = {}
        self._queue: deque[str] = deque()  # keys of calls not taken yet, oldest first
        self._queued = asyncio.Event()
        self._sends: set[asyncio.Task[None]] = set()
        self._keys = (f"{secrets.token_hex(4)}-{n}" for n in itertools.count())
        self.closed = False

    def set_manifest(self, manifest: bytes) -> None:
        """Take the calls' limits from `manifest` (SandboxError if it is not one)."""
        self.limits = RelayLimits.from_manifest(manifest)

    def offer(self, body: bytes, deliver: Deliver, group: set[str]) -> bytes | None:
        """Keep a call frame (already within `limits.max_call_bytes`) until it is taken and
        answered through `deliver`; a `busy` (or, once closed, `refused`) answer frame to give
        at once instead. FrameRefused when it is not a call."""
        call_id, tool, _ = parse_call(body)
        if self.closed:
            return error_frame(call_id, "refused", "the sandbox's host tool calls are closed")
        if len(self._unanswered) >= MAX_UNANSWERED:
            return error_frame(
                call_id,
                "busy",
                f"{MAX_UNANSWERED} host tool calls of this session already wait for an answer; "
                "wait for some to finish, then call again",
            )
        call = _Call(next(self._keys), body, call_id, tool, deliver, group)
        limit = self.limits.timeout_of(tool)
        call.timer = asyncio.get_running_loop().call_later(limit, self._time_is_up, call, limit)
        self._unanswered[call.key] = call
        group.add(call.key)
        self._queue.append(call.key)
        self._queued.set()
        return None

    async def next_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        """Calls not taken yet, oldest first, as (key, call frame); waits up to `max_wait_s`
        (at most MAX_POLL_S) for one; [] if none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(max_wait_s, 0.0), MAX_POLL_S)
        while self.closed or not self._queue:
            if self.closed:
                raise SandboxClosed("the host-tool relay is closed")
            self._queued.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queued.wait(), remaining)
        taken: list[tuple[str, bytes]] = []
        size = 0
        while self._queue and len(taken) < CALLS_PER_POLL:
            call = self._unanswered[self._queue[0]]
            if taken and size + len(call.body) > BYTES_PER_POLL:
                break
            self._queue.popleft()
            call.taken = True
            taken.append((call.key, call.body))
            size += len(call.body)
        return taken

    async def answer(self, key: str, body: bytes) -> None:
        """Deliver `body`, the whole answer frame of the call `key`. An answer over the
        manifest's result cap becomes a `too_large` error; one for a call already answered
        (timed out, or its caller gone) is dropped."""
        call = self._unanswered.get(key)
        if call is None:
            return
        limit = self.limits.max_result_bytes
        if len(body) > limit:
            body = error_frame(
                call.call_id,
                "too_large",
                f"{call.tool} returned {len(body)} bytes, over the limit of {limit}: ask for "
                "less (filter, page, summarise)",
            )
        await self._finish(call, body)

    def forget_group(self, group: set[str]) -> None:
        """Drop the calls that came one way (their caller is gone: nobody to answer)."""
        for key in list(group):
            call = self._unanswered.get(key)
            if call is not None:
                self._forget(call)

    async def close(self) -> None:
        """Drop every call not answered; pollers waiting wake and find it closed."""
        self.closed = True
        self._queued.set()
        for call in list(self._unanswered.values()):
            self._forget(call)
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)

    def _time_is_up(self, call: _Call, limit: float) -> None:
        if self._unanswered.get(call.key) is not call:
            return
        if call.taken and limit > 0:
            # Taken: its taker runs the tool under the same limit; give its answer a moment.
            loop = asyncio.get_running_loop()
            call.timer = loop.call_later(ANSWER_GRACE_S, self._time_is_up, call, 0.0)
            return
        why = (
            "no service took the call"
            if not call.taken
            else "the service that took the call did not answer"
        )
        budget = self.limits.timeout_of(call.tool)
        body = error_frame(
            call.call_id, "timeout", f"{call.tool} was not answered within {budget:g} s: {why}"
        )
        task = asyncio.ensure_future(self._finish(call, body))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _finish(self, call: _Call, body: bytes) -> None:
        """Answer the call once: it leaves the books first, so nothing answers it twice. A
        caller that cannot be reached, or not within its own time, is its `deliver`'s to deal
        with (each `Deliver` bounds its own wait)."""
        self._forget(call)
        with contextlib.suppress(ConnectionError, TimeoutError, SandboxError):
            await call.deliver(body)

    def _forget(self, call: _Call) -> None:
        if self._unanswered.pop(call.key, None) is None:
            return
        if call.timer is not None:
            call.timer.cancel()
        call.group.discard(call.key)
        if not call.taken:
            with contextlib.suppress(ValueError):
                self._queue.remove(call.key)
