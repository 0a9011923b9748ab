"""Proving that a kernel which publishes output after its idle status (Deno's) has published
all of a call's output, without waiting for a quiet spell.

Deno's kernel (cli/js/jupyter_kernel.js since denoland/deno#34083) runs the code on a REPL thread
whose output (`console.log`, `Deno.jupyter.broadcast`, the result's `execute_result`) goes to the
kernel thread over one FIFO channel (cli/ops/jupyter.rs: `op_print`, `op_jupyter_broadcast`). One
loop there, `iopubDrainer`, takes those messages one at a time and publishes each with the
parent header of whichever execute_request is current *when it is taken*; `handleExecute`
publishes the reply and the idle status itself, not through that loop. So a call's output may be
published after its idle, and once the next execute_request has begun, under that request's id.

The proof: right behind the call, a silent execute_request (the flush) whose code broadcasts one
marker message. The kernel takes requests one at a time (`shellLoop` awaits `handleExecute`,
which returns after publishing the idle), and the REPL thread runs the flush's code after all
of the call's output was queued (one thread, one FIFO channel), so the drainer publishes the
marker after all of it, on the same iopub connection. Until the marker comes, whatever the
flush's request id carries is the call's own late output; the marker ends the call. The flush
is silent: no execution count, no result, and `_` is not touched (Jupyter's evaluation path
does not set it). Sent at once rather than after the reply, it costs no round trip of its own.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import cast

from jupyter_client.asynchronous.client import AsyncKernelClient

# The marker's message type: one no Jupyter client shows (Deno passes any type through).
MARK_TYPE = "cir_output_flushed"
# It carries a nonce of its flush's own, so the call's code (which may broadcast anything) cannot
# end the call early by forging a marker. Code that replaced `Deno.jupyter.broadcast` gets no
# marker: its calls end by quiet, unconfirmed. An `error` under the flush's id is the flush's own
# (Deno publishes errors itself, under the request being run, not through the queue): an
# interrupt meant for the call that stopped the flush instead; it is not the call's.
FLUSH_CODE = (
    'try {{ Deno.jupyter.broadcast("' + MARK_TYPE + '", {{"nonce": "{nonce}"}}); }} catch {{}}'
)


@dataclass
class Flush:
    """One flush request in flight, and whether its marker has come back on iopub."""

    msg_id: str
    nonce: str
    marked: asyncio.Event = field(default_factory=asyncio.Event)


def send_flush(client: AsyncKernelClient) -> Flush:
    """Queue the flush request on the shell socket (the kernel runs it after the call)."""
    content = {
        "code": FLUSH_CODE.format(nonce=(nonce := secrets.token_hex(16))),
        "silent": True,
        "store_history": False,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }
    msg = client.session.msg("execute_request", content)
    client.shell_channel.send(msg)
    return Flush(cast(str, msg["header"]["msg_id"]), nonce)
