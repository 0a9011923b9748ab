"""E2B's directory watchers over the workspace, by comparing listings.

The sandbox interface has no way to watch, so a watcher keeps the last listing of its directory
and compares a new one with it: a file that appeared is CREATE, one whose size or time changed is
WRITE, one gone is REMOVE (a rename shows as REMOVE and CREATE; a file made and removed between
two looks is not seen). The sync SDK's watchers are compared when it asks for their events, so an
idle watcher costs nothing; the async SDK's stream compares every POLL_S while it is open. Bounded:
watchers per sandbox, entries per listing, events per answer; a watcher unused for IDLE_TTL_S is
forgotten. Only the workspace can be watched; other paths are refused with the reason.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_pb import EventType

from code_interpreter_wire.errors import FileAccessError, FileMissing
from orchestrator.service import Service
from orchestrator.sessions import Session

POLL_S = 0.5  # how often an open WatchDir stream looks
MAX_WATCHERS_PER_SANDBOX = 16
MAX_WATCHERS = 1024
MAX_ENTRIES = 20_000  # per listing: a larger tree is refused with the reason
MAX_EVENTS = 1_000  # per answer: past it, the rest are merged into the next answer
IDLE_TTL_S = 600.0

Listing = dict[str, tuple[str, int, float]]  # name under the dir -> (type, size, mtime)


async def listing(service: Service, session: Session, relative: str, recursive: bool) -> Listing:
    """What is under a workspace directory (`relative` to the workspace), by name under it."""
    if relative:
        info = await service.files.file_info(session, relative)
        if info is None:
            raise FileMissing(f"path {relative} not found")
        if info.type != "directory":
            raise FileAccessError(f"path {relative} not a directory")
    found = await service.files.list_files(session, relative, recursive=recursive)
    if len(found) > MAX_ENTRIES:
        raise FileAccessError(
            f"{len(found)} entries are too many to watch here (at most {MAX_ENTRIES}); "
            "watch a smaller directory"
        )
    base = len(relative) + 1 if relative else 0
    return {
        info.path[base:]: (info.type, info.size, info.modified_at.timestamp()) for info in found
    }


def changes(old: Listing, new: Listing) -> list[tuple[str, EventType]]:
    """The events that turn `old` into `new`, removals first, each list sorted by name."""
    out = [(name, EventType.REMOVE) for name in sorted(old.keys() - new.keys())]
    for name in sorted(new):
        if name not in old:
            out.append((name, EventType.CREATE))
        elif old[name] != new[name] and new[name][0] != "directory":
            out.append((name, EventType.WRITE))
    return out


@dataclass
class Watcher:
    session_id: str
    relative: str
    recursive: bool
    seen: Listing
    used_at: float = field(default_factory=time.monotonic)


class Watchers:
    """The sync SDK's watchers, by id, for the whole front."""

    def __init__(self) -> None:
        self._watchers: OrderedDict[str, Watcher] = OrderedDict()
        self._streams: Counter[str] = Counter()  # open WatchDir streams by session id

    def _check_room(self, session: Session) -> None:
        self._forget_idle()
        mine = sum(1 for w in self._watchers.values() if w.session_id == session.id)
        mine += self._streams[session.id]
        if mine >= MAX_WATCHERS_PER_SANDBOX or len(self._watchers) >= MAX_WATCHERS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"this sandbox watches {mine} directories already (at most "
                f"{MAX_WATCHERS_PER_SANDBOX}); stop one first",
            )

    @contextmanager
    def stream(self, session: Session) -> Iterator[None]:
        """Count an open WatchDir stream towards the sandbox's watchers while it lasts."""
        self._check_room(session)
        self._streams[session.id] += 1
        try:
            yield
        finally:
            self._streams[session.id] -= 1
            if not self._streams[session.id]:
                del self._streams[session.id]

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for watcher_id, watcher in list(self._watchers.items()):
            if now - watcher.used_at > IDLE_TTL_S:
                del self._watchers[watcher_id]

    async def create(
        self, service: Service, session: Session, relative: str, recursive: bool
    ) -> str:
        self._check_room(session)
        seen = await listing(service, session, relative, recursive)
        watcher_id = secrets.token_hex(8)
        self._watchers[watcher_id] = Watcher(session.id, relative, recursive, seen)
        return watcher_id

    def get(self, session: Session, watcher_id: str) -> Watcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.session_id != session.id:
            raise FileMissing(f"watcher {watcher_id} not found")
        watcher.used_at = time.monotonic()
        return watcher

    async def events(
        self, service: Service, session: Session, watcher_id: str
    ) -> list[tuple[str, EventType]]:
        watcher = self.get(session, watcher_id)
        now = await listing(service, session, watcher.relative, watcher.recursive)
        found = changes(watcher.seen, now)[:MAX_EVENTS]
        # Only what was told counts as seen: the rest comes in the next answer.
        for name, kind in found:
            if kind is EventType.REMOVE:
                watcher.seen.pop(name, None)
            else:
                watcher.seen[name] = now[name]
        return found

    def remove(self, session: Session, watcher_id: str) -> None:
        self.get(session, watcher_id)
        del self._watchers[watcher_id]
