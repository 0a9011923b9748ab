"""A wasm sandbox's host tool calls. Its Python (host_tools.py, as in every kernel) hands each
call frame to the worker, which passes it to the service as a message; they are kept here
(sandbox/tool_call_queue.py: bounded, timed) until the service's relay takes and answers them
(orchestrator/cluster/tool_relay.py, as for a sandbox on another machine), with the same
checks, policy and approvals as a call on a socket. An answer goes back to the worker that made
the call; one for a worker replaced since is dropped (its calls are forgotten with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from code_interpreter_wire.errors import SandboxError
from sandbox.backends.wasm.messages import OFF_LOOP_BYTES
from sandbox.frames import FRAME_TIMEOUT_S, FrameRefused, error_frame, parse_call
from sandbox.host_channel import KERNEL_MODULE
from sandbox.tool_call_queue import ToolCallQueue

log = logging.getLogger(__name__)
MODULE = KERNEL_MODULE.read_text()  # host_tools.py: the same module as in a kernel
# An answer goes to Deno as JSON text inside one frame of at most 64 MiB (sandbox.py's
# MAX_FRAME), where escaping can double it: past this, a `too_large` error instead.
MAX_ANSWER_BYTES = 24 << 20

Send = Callable[[dict[str, Any]], Awaitable[None]]


class WasmToolCalls:
    def __init__(self, send: Send) -> None:
        self.queue = ToolCallQueue()
        self._send = send
        self._manifest: str | None = None
        self._generation = 0
        self._calls: set[str] = set()  # keys of the current worker's calls not answered

    def files(self) -> dict[str, str] | None:
        """What a fresh worker is given for `import host_tools`; None: no tools."""
        if self._manifest is None:
            return None
        return {"manifest": self._manifest, "module": MODULE}

    async def set_manifest(self, manifest: bytes) -> None:
        """The session's tools (`ToolChannel.manifest()`), for the worker now and every one
        after it."""
        self.queue.set_manifest(manifest)
        self._manifest = manifest.decode()
        with contextlib.suppress(SandboxError):  # not running: a fresh worker is given them
            await self._send({"op": "tools", **(self.files() or {})})

    def replaced(self, generation: int) -> None:
        """A fresh worker: the calls of the one before are nobody's to answer."""
        self.queue.forget_group(self._calls)
        self._calls = set()
        self._generation = generation

    async def take(self, body: str, generation: int) -> None:
        """A call frame a worker sent. One over the call size, or that is not a call, is not
        one host_tools.py sends (its code forged it): dropped, said in the log."""
        if generation != self._generation:
            return
        limit = self.queue.limits.max_call_bytes
        try:
            data = body.encode() if len(body) <= limit else b""
        except UnicodeEncodeError:  # a lone surrogate: no call's JSON holds one
            data = b""
        if not data or len(data) > limit:
            log.info("a wasm sandbox sent a host tool call over %d bytes or not text", limit)
            return
        try:
            if len(data) > OFF_LOOP_BYTES:
                call_id, _, _ = await asyncio.to_thread(parse_call, data)
            else:
                call_id, _, _ = parse_call(data)
        except FrameRefused as exc:
            log.info("a wasm sandbox sent a host tool call that is not one: %s", exc)
            return
        if generation != self._generation:  # its worker was replaced meanwhile
            return

        async def deliver(answer: bytes) -> None:
            if generation != self._generation:  # its worker was replaced since
                return
            if len(answer) > MAX_ANSWER_BYTES:  # over what one message to Deno carries
                answer = error_frame(
                    call_id,
                    "too_large",
                    f"the answer is {len(answer)} bytes, over the {MAX_ANSWER_BYTES} a wasm "
                    "sandbox takes: ask for less (filter, page, summarise)",
                )
            message = {"op": "tool_reply", "call": call_id, "body": answer.decode()}
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                await self._send(message)

        busy = self.queue.offer(data, deliver, self._calls)
        if busy is not None:
            with contextlib.suppress(SandboxError, TimeoutError):
                await deliver(busy)
