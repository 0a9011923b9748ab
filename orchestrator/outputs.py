"""Where executions' full outputs and images are kept, so a trimmed tool output can link to them.

Per session, on disk: `<dir>/<session>/<execution id>.json` (the whole Execution) and
`<dir>/<session>/<artifact id>.<ext>` (each image). They go with the session.

A save is written on a thread of its own after its execution's answer has gone (the answer carries
its id): a reader of that id, or of one of its images, waits for the write first. At most
`WRITES_PENDING` are in flight; past that a save waits for its own. A small one without images
(most are: `1+1`, a short print) is kept in memory instead, at once, when nothing is being
written and it evicts nothing, up to `max_memory_bytes` for all: a file and a thread's round trip
were a tenth of a small call's time over HTTP.

Kept outputs have two quotas: bytes per session and bytes in all. Saving past either evicts the
oldest executions (that session's first, then anyone's), with the images only they used. The
accounting is kept in memory, in save order, so a save costs O(1) plus what it evicts, never a
walk of the disk. Asking for an evicted execution or image answers `OutputEvicted` (410).

That is this machine's store. In cluster mode the replicas share one (shared_outputs.py, in the
shared Redis): both are a `KeptOutputs`, which is all the service's parts know of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from code_interpreter_wire.results import Execution
from orchestrator.json_responses import encode_large
from orchestrator.sessions import SessionError

_DROPPED_REMEMBERED = 100_000  # ended sessions whose late saves are refused
ITEM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
IMAGE_TYPES = {"png": "image/png", "jpg": "image/jpeg", "svg": "image/svg+xml"}
_REMEMBERED_EVICTIONS = 100_000  # ids still answered "evicted" (410) rather than "not found"
CHUNK_BYTES = 1 << 20
WRITES_PENDING = 64
# An execution whose JSON is at most this long, without images, may be kept in memory.
SMALL_BYTES = 64 << 10
UNWRITTEN = "it could not be written"
log = logging.getLogger(__name__)


class OutputNotFound(SessionError):
    """No kept execution or artifact has that id (in that session)."""

    status = 404


class OutputEvicted(SessionError):
    """A kept execution or image was dropped to respect the quota on kept outputs."""

    status = 410


@dataclass
class _Kept:
    json_bytes: int
    artifacts: tuple[str, ...]  # file names of the images it shows


@dataclass
class _SessionOutputs:
    executions: OrderedDict[str, _Kept] = field(default_factory=OrderedDict)  # oldest first
    artifacts: dict[str, list[int]] = field(default_factory=dict)  # file name -> [users, bytes]
    in_memory: dict[str, bytes] = field(default_factory=dict)  # execution id -> its JSON
    bytes: int = 0


class KeptBytes(ABC):
    """A kept execution's JSON, opened: eviction may remove it meanwhile, never what is read.
    Read it whole once (`chunks` or `read`), or `close` it unread."""

    size: int

    @abstractmethod
    def chunks(self) -> AsyncIterator[bytes]: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


@dataclass
class KeptFile(KeptBytes):
    """On this machine's disk."""

    file: BinaryIO
    size: int

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(self.file.read, CHUNK_BYTES):
                yield chunk
        finally:
            self.file.close()

    async def close(self) -> None:
        self.file.close()


class KeptValue(KeptBytes):
    """Held whole: in memory, or read whole from a store."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.data

    async def close(self) -> None:
        self.data = b""


@dataclass(frozen=True)
class KeptImage:
    """An image an execution produced: a file on this machine, or its bytes (from a store)."""

    media_type: str
    path: Path | None = None
    data: bytes | None = None


class KeptOutputs(ABC):
    """Where executions' outputs are kept for a session's lifetime, under two quotas."""

    max_bytes_per_session: int
    max_bytes_total: int

    @abstractmethod
    def clear(self) -> None:
        """At the service's start: forget what no live session can ask for any more."""

    @abstractmethod
    async def save(self, session_id: str, execution: Execution) -> str:
        """Keep an execution and its images; its id (readable once `settled`)."""

    @abstractmethod
    async def settled(self, session_id: str, item_id: str) -> None:
        """Once the save of that execution or image is readable."""

    @abstractmethod
    async def open_execution(self, session_id: str, execution_id: str) -> KeptBytes:
        """A kept execution's JSON, as stored (a serialised Execution)."""

    @abstractmethod
    async def artifact(self, session_id: str, artifact_id: str) -> KeptImage: ...

    @abstractmethod
    async def drop(self, session_id: str) -> None:
        """Forget an ended session's outputs; a save of it still under way keeps nothing."""

    @abstractmethod
    async def close(self) -> None:
        """Once every write under way is done (the service is closing)."""

    async def execution(self, session_id: str, execution_id: str) -> Execution:
        """A kept execution, parsed."""
        data = await (await self.open_execution(session_id, execution_id)).read()
        return await asyncio.to_thread(Execution.model_validate_json, data)

    def missing(self, session_id: str, what: str, item_id: str, why: str | None) -> Exception:
        """The error for an id not kept: evicted or not kept (410, saying what to do, from
        `why`) or unknown (404, no `why`)."""
        if why is None:
            return OutputNotFound(f"no {what} {item_id} in session {session_id}")
        if why.startswith(UNWRITTEN):
            return OutputEvicted(
                f"{what} {item_id} was not kept ({why}): run the code again, or have it write "
                "what you need to a file in the workspace"
            )
        reason = "was evicted" if why == "evicted" else f"was not kept ({why})"
        return OutputEvicted(
            f"{what} {item_id} {reason} to respect the quota on kept outputs "
            f"({self.max_bytes_per_session} bytes per session, {self.max_bytes_total} in all; "
            "the oldest go first): run the code again, or have it write what you need to a "
            "file in the workspace"
        )


class OutputStore(KeptOutputs):
    """On this machine's disk (the service's state directory)."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes_per_session: int = 256 << 20,
        max_bytes_total: int = 4 << 30,
        max_memory_bytes: int = 16 << 20,
    ) -> None:
        self.root = root
        self.max_bytes_per_session = max_bytes_per_session
        self.max_bytes_total = max_bytes_total
        self.max_memory_bytes = max_memory_bytes  # of the small ones kept in memory
        self._memory_bytes = 0
        self._lock = threading.Lock()  # saves run on threads
        self._sessions: dict[str, _SessionOutputs] = {}
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()  # every save, oldest first
        self._bytes = 0
        self._evicted: OrderedDict[tuple[str, str], str] = OrderedDict()  # (session, id) -> why
        self._dropped: OrderedDict[str, None] = OrderedDict()  # ended sessions: keep nothing more
        # (session, execution or image id) -> its write, until done
        self._writing: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._slots = asyncio.Semaphore(WRITES_PENDING)
        # One thread: saves are written in the order they were made (the quotas evict the
        # oldest first).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kept-outputs")

    def clear(self) -> None:
        """Start empty: sessions do not outlive the service, so neither do their outputs.
        Called once this instance owns the state directory, never before."""
        with self._lock:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
            self.root.chmod(0o700)
            self._sessions.clear()
            self._order.clear()
            self._evicted.clear()
            self._dropped.clear()
            self._bytes = 0
            self._memory_bytes = 0

    @property
    def bytes_kept(self) -> int:
        return self._bytes

    @property
    def bytes_in_memory(self) -> int:
        return self._memory_bytes

    def _dir(self, session_id: str) -> Path:
        if not ITEM_ID.match(session_id):
            raise OutputNotFound(f"no session {session_id}")
        return self.root / session_id

    async def save(self, session_id: str, execution: Execution) -> str:
        """Evicting older ones past a quota; the id at once, the write under way."""
        execution_id = f"e-{secrets.token_hex(8)}"
        # Only while nothing is written or waits to be (saves are kept in the order made).
        idle = not self._writing and not self._slots.locked()
        if idle and not execution.artifacts and _surely_small(execution):
            data = execution.__pydantic_serializer__.to_json(execution)
            if self._keep_in_memory(session_id, execution_id, data):
                return execution_id
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        writing = loop.run_in_executor(
            self._writer, self._save, session_id, execution_id, execution
        )
        keys = [(session_id, execution_id)] + [(session_id, a.id) for a in execution.artifacts]
        for key in keys:
            self._writing[key] = writing

        def written(done: asyncio.Future[None]) -> None:
            self._slots.release()
            for key in keys:
                if self._writing.get(key) is done:
                    del self._writing[key]
            failed = None if done.cancelled() else done.exception()
            if failed is not None:  # its readers are told why (410), not "no such execution"
                log.error("an output of session %s was not kept", session_id, exc_info=failed)
                with self._lock:
                    for session, item in keys:
                        self._remember(session, item, f"{UNWRITTEN}: {failed}")

        writing.add_done_callback(written)
        return execution_id

    async def close(self) -> None:
        await asyncio.gather(*set(self._writing.values()), return_exceptions=True)
        await asyncio.to_thread(self._writer.shutdown, wait=True)

    @property
    def writes_pending(self) -> int:
        return len(set(self._writing.values()))

    async def settled(self, session_id: str, item_id: str) -> None:
        writing = self._writing.get((session_id, item_id))
        if writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(writing)

    def _keep_in_memory(self, session_id: str, execution_id: str, data: bytes) -> bool:
        """Keep a small execution in memory, now, on the caller's thread; False (nothing
        done) when it must be written instead: too large, over the memory bound, evicting
        something (files are deleted on the writer's thread), or the lock held by a thread
        (this runs on the event loop, which never waits for a lock)."""
        size = len(data)
        if size > SMALL_BYTES or self._memory_bytes + size > self.max_memory_bytes:
            return False
        if not ITEM_ID.match(session_id) or not self._lock.acquire(blocking=False):
            return False
        try:
            if session_id in self._dropped:  # it ended while this run was finishing
                return True
            kept = self._sessions.get(session_id)
            held = 0 if kept is None else kept.bytes
            if held + size > self.max_bytes_per_session:
                return False
            if self._bytes + size > self.max_bytes_total:
                return False
            kept = self._sessions.setdefault(session_id, _SessionOutputs())
            kept.executions[execution_id] = _Kept(size, ())
            kept.in_memory[execution_id] = data
            self._order[(session_id, execution_id)] = None
            kept.bytes += size
            self._bytes += size
            self._memory_bytes += size
            return True
        finally:
            self._lock.release()

    def _save(self, session_id: str, execution_id: str, execution: Execution) -> None:
        d = self._dir(session_id)
        # The slow part, outside the lock, in small encodings: one native call over a big
        # execution would hold the interpreter's lock (and every other request) until done.
        data = encode_large(execution.model_dump(mode="json"))
        images = {f"{a.id}.{a.extension}": a.data for a in execution.artifacts}
        with self._lock:
            if session_id in self._dropped:  # it ended while this run was finishing
                return
            kept = self._sessions.setdefault(session_id, _SessionOutputs())
            new = {name: blob for name, blob in images.items() if name not in kept.artifacts}
            size = len(data) + sum(len(blob) for blob in new.values())
            if size > min(self.max_bytes_per_session, self.max_bytes_total):
                self._remember(session_id, execution_id, f"its {size} bytes are over the quota")
                return
            for name in images:  # taken first: evictions below keep what this one shows
                kept.artifacts.setdefault(name, [0, len(images[name])])[0] += 1
            kept.executions[execution_id] = _Kept(len(data), tuple(images))
            self._order[(session_id, execution_id)] = None
            kept.bytes += size
            self._bytes += size
            gone: list[str] = []
            while kept.bytes > self.max_bytes_per_session:
                gone += self._evict(session_id, next(iter(kept.executions)))
            while self._bytes > self.max_bytes_total:
                gone += self._evict(*next(iter(self._order)))
            # The evicted go before the new is written: the disk never holds more than the
            # quotas, not even for the length of a write.
            for path in gone:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if execution_id not in kept.executions:
                return  # evicted itself: with an image older ones showed, over the quota
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            d.mkdir(exist_ok=True)
            _write(d / f"{execution_id}.json", data)
            for name, blob in new.items():
                _write(d / name, blob)

    def _evict(self, session_id: str, execution_id: str) -> list[str]:
        """Forget the execution (and images no other one shows); return the files to delete."""
        kept = self._sessions[session_id]
        item = kept.executions.pop(execution_id)
        del self._order[(session_id, execution_id)]
        d = self.root / session_id
        gone = [str(d / f"{execution_id}.json")]
        held = kept.in_memory.pop(execution_id, None)
        if held is not None:
            self._memory_bytes -= len(held)
            gone.clear()
        freed = item.json_bytes
        self._remember(session_id, execution_id, "evicted")
        for name in item.artifacts:
            users = kept.artifacts[name]
            users[0] -= 1
            if users[0] == 0:
                del kept.artifacts[name]
                freed += users[1]
                gone.append(str(d / name))
                self._remember(session_id, name.rsplit(".", 1)[0], "evicted")
        kept.bytes -= freed
        self._bytes -= freed
        return gone

    def _remember(self, session_id: str, item_id: str, why: str) -> None:
        self._evicted[(session_id, item_id)] = why
        if len(self._evicted) > _REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)

    def _missing(self, session_id: str, what: str, item_id: str) -> Exception:
        return self.missing(session_id, what, item_id, self._evicted.get((session_id, item_id)))

    async def open_execution(self, session_id: str, execution_id: str) -> KeptBytes:
        return await asyncio.to_thread(self._open_execution, session_id, execution_id)

    def _open_execution(self, session_id: str, execution_id: str) -> KeptBytes:
        if not ITEM_ID.match(execution_id):
            raise OutputNotFound(f"no execution {execution_id} in session {session_id}")
        with self._lock:
            kept = self._sessions.get(session_id)
            held = None if kept is None else kept.in_memory.get(execution_id)
        if held is not None:
            return KeptValue(held)
        try:
            f = open(self._dir(session_id) / f"{execution_id}.json", "rb")  # noqa: SIM115
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(session_id, "execution", execution_id) from None
        return KeptFile(f, os.fstat(f.fileno()).st_size)

    async def artifact(self, session_id: str, artifact_id: str) -> KeptImage:
        if not ITEM_ID.match(artifact_id):
            raise OutputNotFound(f"no artifact {artifact_id} in session {session_id}")
        for ext, mime in IMAGE_TYPES.items():
            path = self._dir(session_id) / f"{artifact_id}.{ext}"
            if path.is_file():
                return KeptImage(mime, path=path)
        raise self._missing(session_id, "image", artifact_id)

    async def drop(self, session_id: str) -> None:
        await asyncio.to_thread(self._drop, session_id)

    def _drop(self, session_id: str) -> None:
        with self._lock:
            self._dropped[session_id] = None
            while len(self._dropped) > _DROPPED_REMEMBERED:
                self._dropped.popitem(last=False)
            kept = self._sessions.pop(session_id, None)
            if kept is not None:
                for execution_id in kept.executions:
                    del self._order[(session_id, execution_id)]
                self._bytes -= kept.bytes
                self._memory_bytes -= sum(len(held) for held in kept.in_memory.values())
            shutil.rmtree(self._dir(session_id), ignore_errors=True)


def _surely_small(execution: Execution) -> bool:
    """Whether its JSON is surely short enough to be encoded on the event loop, judged from
    its texts without encoding it: only results of plain text forms are counted."""
    size = len(execution.stdout) + len(execution.stderr) + len(execution.notice or "")
    if execution.error is not None:
        error = execution.error
        size += len(error.name) + len(error.value) + len(error.traceback)
    for result in execution.results:
        if result.json_data is not None or result.chart or result.data or result.extra:
            return False
        if result.png is not None or result.jpeg is not None:  # an image not decoded: any size
            return False
        for text in (result.text, result.html, result.markdown, result.latex, result.javascript):
            size += len(text or "")
        size += len(result.svg or "") + len(result.pdf or "")
    # JSON escapes can lengthen a text: its characters are counted six times over
    return size * 6 <= SMALL_BYTES


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
