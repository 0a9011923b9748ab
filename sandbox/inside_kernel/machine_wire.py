"""The channel between the host and a gVisor machine's agent: its frames, its limits, a stream.

The agent (machine_agent.py) and the host's end (backends/gvisor/agent_channel.py) both take
the format from here, so the two cannot drift apart. One framed, multiplexed channel over the
agent's stdin/stdout carries:

- control (stream 0): JSON requests from the host, each answered by id; events from the agent;
- byte streams, each flow-controlled by credit: connections the host asks for to Unix sockets
  inside (the kernels' ZeroMQ sockets, a supervisor's interrupt socket), connections accepted on
  sockets the agent listens on inside (the host-tool and egress channels), and the stdio of the
  children it starts (kernels, commands, terminals).

Frame: `>BII` kind, stream id, payload length, then the payload (at most MAX_PAYLOAD bytes).
    CONTROL 0  JSON object, stream 0
    DATA    1  bytes, within the credit the receiver has granted for the stream
    EOF     2  the sender sends no more on this stream (half-close)
    CLOSE   3  the stream is gone both ways
    CREDIT  4  `>I`: the receiver may take that many more bytes of the stream
Each side may send WINDOW bytes of a stream before any credit. The host opens even stream ids,
the agent odd ones.

Requests (`{"id": n, "op": ...}`, answered `{"id": n, "ok": true, ...}` or `"ok": false, "error"`):
    hello    -> {"version", "children": [{"pid", "tag", "tty", "exit": null | {...}}]}
    spawn    argv, env, cwd, uid, gid, tag, marker, io (stream), err (stream | null),
             tty ({"rows", "cols"} | null), files ([{"path", "data", "mode"}]) -> {"pid"}
    adopt    pid, io, err, replay -> {}: a child's output goes to new streams, its tail
             replayed first (`replay` true), not (false), or only what it wrote while no
             host listened ("unsent")
    unsaveable -> {"reasons"}: what gVisor could not save (network sockets)
    signal   pid, signum -> {}: to its process group and every process carrying its marker
    resize   pid, rows, cols -> {}
    connect  stream, path -> {}
    listen   path, channel, uid, gid -> {}
    detach   -> {}: every stream is dropped (children keep running, their output kept in a
             bounded tail), nothing more is written until the next hello: the host may now
             checkpoint the sandbox, and talks again over the pipes a restore gives.
Events: {"event": "exited", "pid", "code" | "signal"}, {"event": "accepted", "stream", "channel"}.

Standard library only: it runs inside the machine too, imported by the agent as a sibling file.
"""

from __future__ import annotations

import struct
from typing import Generic, TypeVar

# What a child's stream belongs to (machine_children.Child), named only by the agent that pairs
# them: this module imports no sibling.
ChildT = TypeVar("ChildT")

VERSION = 1
HEADER = struct.Struct(">BII")
CREDIT = struct.Struct(">I")
CONTROL, DATA, EOF, CLOSE, GRANT = 0, 1, 2, 3, 4
MAX_PAYLOAD = 64 << 10
WINDOW = 256 << 10
MAX_STREAMS = 4096
MAX_ACCEPTED = 64  # connections open at once per listening socket


class Stream(Generic[ChildT]):
    """One byte stream to the host. A socket stream reads and writes its own fd; a child's
    stream writes the child's input (`fd`, or -1) while its output is read by the child."""

    def __init__(self, sid: int, fd: int, child: ChildT | None = None) -> None:
        self.sid = sid
        self.fd = fd
        self.child = child
        self.credit = WINDOW  # what we may still send to the host
        self.inbound = bytearray()  # host data not yet written to fd
        self.reading = child is None  # a socket not yet at EOF
        self.eof_sent = False
        self.host_eof = False
