"""The first process of a gVisor machine sandbox: the host's one way in, over its stdin/stdout.

A sandbox gVisor can checkpoint may hold no socket bound on a host path, and the kernels, host
tools and egress all used to be reached that way. So the host reaches everything inside through
this agent instead, over the container's stdio, which a restore hands over to new pipes: one
framed, multiplexed channel of requests, events and byte streams under credit (its format, its
requests and its limits: machine_wire.py; the children the agent starts: machine_children.py;
the workspace's files, for a host that cannot reach them: machine_files.py).

Standard library only, run with -I -S: it runs beside code it must not trust, which may also try
to talk to it; it trusts its stdin alone. Single-threaded: one selector, non-blocking fds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # on the host (its tests, the template digest): in the package
    from sandbox.inside_kernel import machine_children as children
    from sandbox.inside_kernel import machine_files as files
    from sandbox.inside_kernel import machine_root as root
    from sandbox.inside_kernel import machine_wire as wire
else:
    # In the machine it runs as a script, with -I: Python leaves the script's own directory off
    # sys.path, so it is put first here, on purpose, for the siblings bound read-only beside it
    # (backends/gvisor/machine.py). Nothing in the sandbox can write there, and no file there
    # is named like a standard module.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import machine_children as children
    import machine_files as files
    import machine_root as root
    import machine_wire as wire

_READ = 1 << 16


class Agent:
    def __init__(self, stdin: int, stdout: int) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self.sel = selectors.DefaultSelector()
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.streams: dict[int, wire.Stream[children.Child]] = {}
        # Streams that carry a workspace file (or a listing) rather than an fd's bytes, by id.
        self.transfers: dict[int, files.Source | files.FileSink] = {}
        self.workspace = files.WORKSPACE
        self.children: dict[int, children.Child] = {}
        self.oom_kills: int | None = None
        self.oom_killed_since()  # the count so far: what comes after is news
        self.listeners: dict[int, tuple[socket.socket, str, set[int]]] = {}
        self.next_sid = 1
        self.attached = True
        self.sig_r, sig_w = os.pipe()
        os.set_blocking(self.sig_r, False)
        os.set_blocking(sig_w, False)
        signal.set_wakeup_fd(sig_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # Shrugged off by a handler, not ignored: an ignored signal stays ignored in the
        # children across their exec, and a command must end at SIGTERM, a kernel at SIGINT.
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            signal.signal(getattr(signal, name), lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # restored in children by Popen
        # The host's pipes are read and written blocking, stdin by a thread of its own: after a
        # restore they are new host files, which gVisor's epoll does not report ready again.
        self.host_r, self.host_w = socket.socketpair()
        self.host_r.setblocking(False)
        threading.Thread(target=self._pump_stdin, name="stdin", daemon=True).start()
        self.sel.register(self.host_r.fileno(), selectors.EVENT_READ, "host")
        self.sel.register(self.sig_r, selectors.EVENT_READ, "signals")
        # sudo's way to root (machine_root.py): gVisor keeps setuid from ever working.
        self.root = root.RootRequests(unwatch=lambda fd: self._unwatch(fd))
        self.sel.register(self.root.listen().fileno(), selectors.EVENT_READ, "root")

    def _unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(fd)

    def _pump_stdin(self) -> None:
        while True:
            try:
                data = os.read(self.stdin, _READ)
            except OSError:
                data = b""
            if not data:  # the host went away: a restore may give us a new stdin
                time.sleep(0.5)
                continue
            self.host_w.sendall(data)

    # --- the selector -------------------------------------------------------------------------
    def watch(self, fd: int, what: Any, *, reading: bool = False, writing: bool = False) -> None:
        events = (selectors.EVENT_READ if reading else 0) | (
            selectors.EVENT_WRITE if writing else 0
        )
        try:
            key = self.sel.get_key(fd)
        except KeyError:
            if events:
                self.sel.register(fd, events, what)
            return
        if not events:
            self.sel.unregister(fd)
        elif key.events != events:
            self.sel.modify(fd, events, what)

    def forget(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(fd)

    # --- writing to the host ------------------------------------------------------------------
    def frame(self, kind: int, sid: int, payload: bytes = b"") -> None:
        if self.attached:
            self.outbuf += wire.HEADER.pack(kind, sid, len(payload)) + payload
            self.flush()

    def control(self, message: dict[str, Any]) -> None:
        self.frame(wire.CONTROL, 0, json.dumps(message).encode())

    def flush(self) -> None:
        try:
            while self.outbuf:
                del self.outbuf[: os.write(self.stdout, self.outbuf[:_READ])]
        except OSError:  # the host's end is gone: nothing more to say until a restore
            self.outbuf.clear()

    # --- reading from the host ----------------------------------------------------------------
    def read_host(self) -> None:
        try:
            data = self.host_r.recv(_READ)
        except BlockingIOError:
            return
        self.inbuf += data
        while len(self.inbuf) >= wire.HEADER.size:
            kind, sid, size = wire.HEADER.unpack_from(self.inbuf)
            if size > wire.MAX_PAYLOAD:
                raise SystemExit(f"machine agent: a frame of {size} bytes from the host")
            if len(self.inbuf) < wire.HEADER.size + size:
                break
            payload = bytes(self.inbuf[wire.HEADER.size : wire.HEADER.size + size])
            del self.inbuf[: wire.HEADER.size + size]
            self.dispatch(kind, sid, payload)

    def dispatch(self, kind: int, sid: int, payload: bytes) -> None:
        if kind == wire.CONTROL:
            self.answer(json.loads(payload))
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        transfer = self.transfers.get(sid)
        if transfer is not None:
            self.transfer_frame(stream, transfer, kind, payload)
        elif kind == wire.DATA:
            stream.inbound += payload
            self.write_stream(stream)
        elif kind == wire.EOF:
            stream.host_eof = True
            self.write_stream(stream)
        elif kind == wire.CLOSE:
            self.drop(stream, tell=False)
        elif kind == wire.GRANT:
            stream.credit += wire.CREDIT.unpack(payload)[0]
            if stream.child is not None:
                self.resume_child(stream.child)
            else:
                self.stream_state(stream)

    def answer(self, request: dict[str, Any]) -> None:
        op = str(request.get("op"))
        try:
            reply = getattr(self, "op_" + op)(request)
            reply.update(id=request.get("id"), ok=True)
        except files.Refused as exc:  # an answer the host maps to its typed error
            reply = {"id": request.get("id"), "ok": True, **exc.reply()}
        except Exception as exc:  # every failure is the host's to read
            reply = {"id": request.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.control(reply)
        if op == "detach" and reply["ok"]:
            self.attached = False

    # --- streams ------------------------------------------------------------------------------
    def add_stream(
        self, sid: int, fd: int, child: children.Child | None = None
    ) -> wire.Stream[children.Child]:
        if sid in self.streams or len(self.streams) >= wire.MAX_STREAMS:
            raise ValueError(f"stream {sid} cannot be opened")
        if fd >= 0:
            os.set_blocking(fd, False)
        stream = wire.Stream(sid, fd, child)
        self.streams[sid] = stream
        self.stream_state(stream)
        return stream

    def stream_state(self, stream: wire.Stream[children.Child]) -> None:
        if stream.fd >= 0:
            reading = stream.reading and stream.credit > 0
            self.watch(stream.fd, stream, reading=reading, writing=bool(stream.inbound))

    def write_stream(self, stream: wire.Stream[children.Child]) -> None:
        while stream.inbound and stream.fd >= 0:
            try:
                written = os.write(stream.fd, stream.inbound[:_READ])
            except BlockingIOError:
                break
            except OSError:  # its reader is gone: what the host sends is dropped
                written = len(stream.inbound)
            del stream.inbound[:written]
            self.frame(wire.GRANT, stream.sid, wire.CREDIT.pack(written))
        if stream.fd < 0 and stream.inbound:  # nobody reads it: granted back, dropped
            self.frame(wire.GRANT, stream.sid, wire.CREDIT.pack(len(stream.inbound)))
            stream.inbound.clear()
        if not stream.inbound and stream.host_eof and stream.fd >= 0:
            self.end_input(stream)
        self.stream_state(stream)

    def end_input(self, stream: wire.Stream[children.Child]) -> None:
        child = stream.child
        if child is None:
            try:
                with socket.socket(fileno=os.dup(stream.fd)) as half:
                    half.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        if child.tty:  # a terminal's input ends with its end-of-file character
            with contextlib.suppress(OSError):
                os.write(stream.fd, b"\x04")
            return
        self.forget(stream.fd)
        os.close(stream.fd)
        child.input = stream.fd = -1

    def read_stream(self, stream: wire.Stream[children.Child]) -> None:
        try:
            data = os.read(stream.fd, min(_READ, stream.credit))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            stream.credit -= len(data)
            self.frame(wire.DATA, stream.sid, data)
        else:
            stream.reading = False
            stream.eof_sent = True
            self.frame(wire.EOF, stream.sid)
        self.stream_state(stream)

    def drop(self, stream: wire.Stream[children.Child], *, tell: bool = True) -> None:
        if self.streams.pop(stream.sid, None) is None:
            return
        if tell:
            self.frame(wire.CLOSE, stream.sid)
        transfer = self.transfers.pop(stream.sid, None)
        if transfer is not None:  # a file not written to the end is removed
            transfer.close()
            return
        child = stream.child
        if child is not None:  # the child lives on, its output kept in its tail
            for name, bound in child.streams.items():
                if bound is stream:
                    child.streams[name] = None
            if stream.fd >= 0:
                self.forget(stream.fd)
            self.resume_child(child)
            return
        self.forget(stream.fd)
        for _, _, open_fds in self.listeners.values():
            open_fds.discard(stream.fd)
        os.close(stream.fd)

    # --- workspace files ----------------------------------------------------------------------
    def start_transfer(
        self, sid: int, transfer: files.Source | files.FileSink
    ) -> wire.Stream[children.Child]:
        """A stream of the host's for a file's bytes: no fd of its own to watch (a regular
        file is always "ready"), it moves as frames and credit come."""
        try:
            stream = self.add_stream(sid, -1)
        except BaseException:
            transfer.close()
            raise
        self.transfers[sid] = transfer
        return stream

    def transfer_frame(
        self,
        stream: wire.Stream[children.Child],
        transfer: files.Source | files.FileSink,
        kind: int,
        payload: bytes,
    ) -> None:
        if kind == wire.CLOSE:
            self.drop(stream, tell=False)
        elif kind == wire.GRANT:
            stream.credit += wire.CREDIT.unpack(payload)[0]
            self.send_source(stream)
        elif isinstance(transfer, files.FileSink) and kind == wire.DATA:
            if not transfer.done:  # else it failed already, and said so: the rest is dropped
                try:
                    transfer.write(payload)
                except files.Refused as exc:
                    self.send_result(stream, exc.reply())
            self.frame(wire.GRANT, stream.sid, wire.CREDIT.pack(len(payload)))
        elif isinstance(transfer, files.FileSink) and kind == wire.EOF and not transfer.done:
            try:
                result = transfer.finish()
            except files.Refused as exc:
                result = exc.reply()
            self.send_result(stream, result)

    def send_source(self, stream: wire.Stream[children.Child]) -> None:
        """As much of a file (or listing) as the stream's credit allows, at most a window's
        worth each time: a big file never holds up the loop."""
        source = self.transfers.get(stream.sid)
        if not isinstance(source, files.Source) or stream.eof_sent:
            return
        while stream.credit > 0:
            try:
                data = source.read(min(wire.MAX_PAYLOAD, stream.credit))
            except OSError:  # closed short: the host sees less than the size it was told
                self.drop(stream)
                return
            if not data:
                source.close()
                stream.eof_sent = True
                self.frame(wire.EOF, stream.sid)
                return
            stream.credit -= len(data)
            self.frame(wire.DATA, stream.sid, data)

    def send_result(self, stream: wire.Stream[children.Child], result: dict[str, Any]) -> None:
        """How a file write ended, on its own stream, which then ends."""
        data = json.dumps(result).encode()
        stream.credit -= len(data)
        self.frame(wire.DATA, stream.sid, data)
        stream.eof_sent = True
        self.frame(wire.EOF, stream.sid)

    # --- children -----------------------------------------------------------------------------
    def read_child(self, child: children.Child, name: str, fd: int) -> None:
        if child.out.get(name) != fd:
            return  # already at its end
        stream = child.streams[name]
        want = _READ if stream is None else min(_READ, stream.credit)
        if want <= 0:  # the host is behind: the child waits on its pipe
            self.forget(fd)
            return
        try:
            data = os.read(fd, want)
        except BlockingIOError:
            return
        except OSError:  # a terminal's master reads EIO once every holder of its side is gone
            data = b""
        if not data:
            self.end_output(child, name, fd)
            return
        child.keep(name, data)
        if stream is not None:
            stream.credit -= len(data)
            self.frame(wire.DATA, stream.sid, data)
        else:
            child.unsent[name] = min(child.unsent[name] + len(data), child.tail_sizes[name])

    def end_output(self, child: children.Child, name: str, fd: int) -> None:
        """The child's output `name` is over: its stream told, its descriptor closed."""
        self.forget(fd)
        os.close(fd)
        del child.out[name]
        stream = child.streams[name]
        if stream is not None and not stream.eof_sent:
            stream.eof_sent = True
            self.frame(wire.EOF, stream.sid)
        if child.tty and child.input >= 0:
            os.close(child.input)
            child.input = -1

    def resume_child(self, child: children.Child) -> None:
        for name, fd in child.out.items():
            stream = child.streams[name]
            reading = stream is None or stream.credit > 0
            self.watch(fd, (child, name), reading=reading)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.root.reaped(pid, status):
                continue
            child = self.children.get(pid)
            if child is None or child.exit is not None:
                continue  # an orphan handed to us (PID 1), or a pid used again since
            if os.WIFSIGNALED(status):
                child.exit = {"signal": os.WTERMSIG(status)}
            else:
                child.exit = {"code": os.WEXITSTATUS(status)}
            killed = child.exit.get("signal") == signal.SIGKILL or child.exit.get("code") == 137
            oom = self.oom_killed_since()
            if killed and oom is not None:  # where this kernel counts its OOM kills
                child.exit["oom"] = oom
            for name, fd in list(child.out.items()):  # what it wrote before it ended, first
                while name in child.out and self.sel.get_map().get(fd) is not None:
                    before = child.tail_sizes[name]
                    self.read_child(child, name, fd)
                    if child.tail_sizes[name] == before:
                        break
                # A terminal ends with its process: gVisor's master does not report the
                # slave's last close (Linux's reads EIO), and the session is over anyway.
                if child.tty and name in child.out:
                    self.end_output(child, name, fd)
            self.report_exit(child)

    def oom_killed_since(self) -> bool | None:
        """Whether the kernel's OOM killer killed anything since the last ask (a machine with
        a kernel of its own: its /proc/vmstat counts); None where it is not counted."""
        try:
            with open("/proc/vmstat", "rb") as f:
                counts = dict(line.split() for line in f.read().splitlines() if b" " in line)
            now = int(counts[b"oom_kill"])
        except (OSError, KeyError, ValueError):
            return None
        before, self.oom_kills = self.oom_kills, now
        return before is not None and now > before

    def report_exit(self, child: children.Child) -> None:
        if child.exit is not None:
            self.control({"event": "exited", "pid": child.pid, **child.exit})

    def forget_ended(self) -> None:
        for pid, child in list(self.children.items()):
            if (
                child.exit is not None
                and not child.out
                and child.streams == {"io": None, "err": None}
            ):
                del self.children[pid]

    # --- requests -----------------------------------------------------------------------------
    def op_hello(self, request: dict[str, Any]) -> dict[str, Any]:
        self.attached = True
        if request.get("workspace"):  # where the workspace is, if not at files.WORKSPACE
            self.workspace = str(request["workspace"])
        # A virtual machine restored from a save wakes with the save's clock and random state
        # (and a template's or snapshot's other restores share that state): the host says the
        # time and gives fresh entropy, which the machine's own kernel reseeds from at once.
        if request.get("now") is not None:
            time.clock_settime(time.CLOCK_REALTIME, float(request["now"]))
        if request.get("entropy"):
            _reseed(bytes.fromhex(str(request["entropy"])))
        # Root as the host's setting says now (a restored machine listened as its maker said).
        if request.get("root") is False and self.root.listener is not None:
            self.root.stop_listening()
        elif request.get("root") is True and self.root.listener is None:
            self.sel.register(self.root.listen().fileno(), selectors.EVENT_READ, "root")
        listed = [
            {"pid": c.pid, "tag": c.tag, "tty": c.tty, "exit": c.exit}
            for c in self.children.values()
        ]
        return {"version": wire.VERSION, "children": listed}

    def op_spawn(self, request: dict[str, Any]) -> dict[str, Any]:
        self.forget_ended()
        if len(self.children) >= children.MAX_CHILDREN:
            raise RuntimeError(f"the sandbox runs {children.MAX_CHILDREN} processes already")
        uid, gid = int(request["uid"]), int(request["gid"])
        children.write_files(request.get("files") or [], uid, gid)
        io_sid, err_sid = int(request["io"]), request.get("err")
        if io_sid in self.streams or err_sid in self.streams:
            raise ValueError("its streams are taken")
        child = children.start_child(request, uid, gid, with_err=err_sid is not None)
        self.children[child.pid] = child
        self.bind(child, io_sid, None if err_sid is None else int(err_sid))
        return {"pid": child.pid}

    def bind(
        self, child: children.Child, io_sid: int, err_sid: int | None, *, replay: bool | str = True
    ) -> None:
        """Give the child's output (and input) to new streams; what it kept of it goes first:
        all its tail (`replay` true), none, or what it wrote while no host listened
        ("unsent")."""
        for sid in (io_sid, err_sid):
            if sid is not None and (sid in self.streams or len(self.streams) >= wire.MAX_STREAMS):
                raise ValueError(f"stream {sid} cannot be opened")
        for name in ("io", "err"):
            old = child.streams[name]
            if old is not None:
                self.drop(old)
        child.streams["io"] = self.add_stream(io_sid, child.input, child)
        if err_sid is not None and not child.tty:
            child.streams["err"] = self.add_stream(err_sid, -1, child)
        for name in ("io", "err"):
            stream = child.streams[name]
            if stream is None:
                continue
            chunks = list(child.tails[name]) if replay else []
            if replay == "unsent":
                unsent = child.unsent[name]
                chunks = [b"".join(chunks)[-unsent:]] if unsent else []
            child.unsent[name] = 0
            for chunk in chunks:
                for at in range(0, len(chunk), wire.MAX_PAYLOAD):
                    piece = chunk[at : at + wire.MAX_PAYLOAD]
                    stream.credit -= len(piece)
                    self.frame(wire.DATA, stream.sid, piece)
            if name not in child.out:
                stream.eof_sent = True
                self.frame(wire.EOF, stream.sid)
        self.resume_child(child)

    def op_adopt(self, request: dict[str, Any]) -> dict[str, Any]:
        child = self.children[int(request["pid"])]
        err = request.get("err")
        asked = request.get("replay", True)
        replay = "unsent" if asked == "unsent" else bool(asked)
        self.bind(child, int(request["io"]), None if err is None else int(err), replay=replay)
        if child.exit is not None:  # told again, to the host that adopts it
            self.report_exit(child)
        return {}

    def op_signal(self, request: dict[str, Any]) -> dict[str, Any]:
        children.signal_child(self.children[int(request["pid"])], int(request["signum"]))
        return {}

    def op_resize(self, request: dict[str, Any]) -> dict[str, Any]:
        child = self.children[int(request["pid"])]
        if child.tty and child.input >= 0:
            children.set_size(child.input, int(request["rows"]), int(request["cols"]))
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGWINCH)
        return {}

    def op_connect(self, request: dict[str, Any]) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(request["path"]))
            self.add_stream(int(request["stream"]), sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()
        return {}

    def op_listen(self, request: dict[str, Any]) -> dict[str, Any]:
        path = str(request["path"])
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(path):
                os.unlink(path)
            sock.bind(path)
            os.chown(path, int(request["uid"]), int(request["gid"]))
            os.chmod(path, 0o600)
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.listeners[sock.fileno()] = (sock, str(request["channel"]), set())
        self.sel.register(sock.fileno(), selectors.EVENT_READ, "listener")
        return {}

    def op_unsaveable(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"reasons": children.network_sockets()}

    def op_file_read(self, request: dict[str, Any]) -> dict[str, Any]:
        source, size = files.open_file(self.workspace, request["path"], int(request["max_bytes"]))
        self.send_source(self.start_transfer(int(request["stream"]), source))
        return {"size": size}

    def op_file_write(self, request: dict[str, Any]) -> dict[str, Any]:
        mode = request.get("mode")
        uid, gid = int(request["uid"]), int(request["gid"])
        sink = files.open_sink(
            self.workspace, request["path"], uid, gid, None if mode is None else int(mode)
        )
        self.start_transfer(int(request["stream"]), sink)
        return {}

    def op_file_list(self, request: dict[str, Any]) -> dict[str, Any]:
        limit = max(0, min(int(request.get("limit") or files.LIST_LIMIT), files.LIST_LIMIT))
        recursive = bool(request.get("recursive"))
        source, count, truncated = files.listing(
            self.workspace, request.get("path", ""), recursive, limit
        )
        self.send_source(self.start_transfer(int(request["stream"]), source))
        return {"count": count, "truncated": truncated}

    def op_file_remove(self, request: dict[str, Any]) -> dict[str, Any]:
        files.remove(self.workspace, request["path"])
        return {}

    def op_file_mkdir(self, request: dict[str, Any]) -> dict[str, Any]:
        uid, gid = int(request["uid"]), int(request["gid"])
        return files.make_dir(self.workspace, request["path"], uid, gid)

    def op_file_stat(self, request: dict[str, Any]) -> dict[str, Any]:
        return files.stat_path(self.workspace, request["path"])

    def op_detach(self, request: dict[str, Any]) -> dict[str, Any]:
        for stream in list(self.streams.values()):
            self.drop(stream, tell=False)
        return {}

    def accept(self, fd: int) -> None:
        sock, channel, open_fds = self.listeners[fd]
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        if (
            not self.attached
            or len(open_fds) >= wire.MAX_ACCEPTED
            or len(self.streams) >= wire.MAX_STREAMS
        ):
            conn.close()
            return
        sid = self.next_sid
        self.next_sid += 2
        stream = self.add_stream(sid, conn.detach())
        open_fds.add(stream.fd)
        self.control({"event": "accepted", "stream": sid, "channel": channel})

    def serve_root(self, what: str, fd: int) -> None:
        """sudo's askers (machine_root.py): whatever one of them sends, the agent carries on;
        only that asker is dropped."""
        try:
            if what == "root":
                conn = self.root.accept()
                if conn is not None:
                    self.sel.register(conn.fileno(), selectors.EVENT_READ, "asker")
            else:
                self.root.readable(fd)
        except Exception:
            self.root.drop_fd(fd)

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            for key, events in self.sel.select():
                if self.sel.get_map().get(key.fd) is not key:
                    continue  # dropped (or its fd reused) by an event before it in this batch
                what = key.data
                if what == "host":
                    self.read_host()
                elif what == "signals":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.sig_r, 4096)
                    self.reap()
                elif what == "listener":
                    self.accept(key.fd)
                elif what in ("root", "asker"):
                    self.serve_root(what, key.fd)
                elif isinstance(what, wire.Stream):
                    if events & selectors.EVENT_WRITE:
                        self.write_stream(what)
                    if events & selectors.EVENT_READ and what.sid in self.streams:
                        self.read_stream(what)
                elif isinstance(what, tuple):
                    self.read_child(what[0], what[1], key.fd)


_RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
_RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def _reseed(entropy: bytes) -> None:
    """Credit `entropy` to the kernel's pool and reseed its generator from it now (root only):
    every reader of /dev/urandom or getrandom after this draws apart from the save's."""
    if not 16 <= len(entropy) <= 512:
        raise ValueError("entropy of 16 to 512 bytes is expected")
    with open("/dev/urandom", "wb", buffering=0) as pool:
        header = struct.pack("ii", len(entropy) * 8, len(entropy))
        fcntl.ioctl(pool, _RNDADDENTROPY, header + entropy)
        fcntl.ioctl(pool, _RNDRESEEDCRNG)


def main() -> None:
    os.umask(0o022)
    agent = Agent(sys.stdin.fileno(), sys.stdout.fileno())
    try:
        agent.run()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise


if __name__ == "__main__":
    main()
