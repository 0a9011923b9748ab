"""Which execution, command, background process or terminal of a session started the code that
calls a host tool, and whether it still runs.

Each one gets a token when it starts (`exec-...`, `command-...`, `process-...`, `terminal-...`):
an execution in its execute request, a process in its environment (sandbox/host_channel.py).
The sandbox's start-up code hands it on to the threads, tasks and child processes it starts, and
every call frame names it. A call whose origin does not run any more, or that names none, is
refused (`refusal_text`); an approval shows the code of the one that made the call, not of
whatever runs now; a wait for an approval ends when its origin ends (approvals.py).

With a shared store (cluster mode: another replica may take a session's calls), the origins of
a session with host tools are also written there while they run, with a short time to live that
this replica renews while each runs (however long it queued for its kernel first), so a dead
replica's expire by themselves: a replica that takes a call of code another replica runs finds
its origin there, with the time by which a wait for its approval must end.

What this cannot stop: code in the sandbox controls its own process, so it can name another
origin of the same session that is running now (docs/governance.md says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from orchestrator.governance.stores.origin_record import OriginRecord
from sandbox.host_channel import TOOL_ORIGIN_ENV

log = logging.getLogger(__name__)

OriginKind = Literal["execution", "command", "process", "terminal"]
_PREFIXES: dict[OriginKind, str] = {
    "execution": "exec",
    "command": "command",
    "process": "process",
    "terminal": "terminal",
}
_KINDS = {prefix: kind for kind, prefix in _PREFIXES.items()}
_WORDS: dict[OriginKind, str] = {
    "execution": "execution",
    "command": "command",
    "process": "background process",
    "terminal": "terminal",
}
# A tool call's wait ends this long before its execution's time limit (at most), so the code has
# time to read the denial; a fifth of the limit for short ones.
EXECUTION_MARGIN_S = 2.0
SHARED_TTL_S = 60.0  # a shared origin's time to live, renewed while it runs here
SHARED_REFRESH_S = 20.0  # how often
_RULE = (
    "host tools are called only while the execution, command or process that started the "
    "calling thread, task or process runs: wait for the threads and tasks you start before "
    "the code ends"
)


def make_origin(kind: OriginKind, replica: str = "") -> str:
    """A new token: the kind, the replica that made it, then chance."""
    return f"{_PREFIXES[kind]}-{replica}{secrets.token_hex(8)}"


def word_for(kind: OriginKind) -> str:
    return _WORDS[kind]


def kind_of(origin: str) -> OriginKind | None:
    """The kind a token names by its prefix, or None for one this service never makes."""
    prefix, _, rest = origin.partition("-")
    return _KINDS.get(prefix) if rest else None


def refusal_text(origin: str | None) -> str:
    """Why a call from `origin` is refused: nothing it names runs in the session now."""
    if origin is None:
        return (
            "no execution running: the call names none (it came from a thread or process that "
            "no execution, command or terminal of this session started, or one whose "
            f"environment was cleared); {_RULE}"
        )
    kind = kind_of(origin)
    if kind is None:
        return (
            f"no execution running: the origin the call names ({origin[:40]!r}) is none of "
            f"this session's; {_RULE}"
        )
    return (
        f"no execution running: the {word_for(kind)} that started the caller ({origin}) has "
        f"ended; {_RULE}"
    )


@dataclass
class RunningCode:
    """One origin while it runs: its code or command line (what a tool call it makes is shown
    with), when its time limit ends (what its calls' waits end before), the requests its calls
    wait on (abandoned if it ends first), and the approval outcomes of its calls (told to the
    model with an execution's output)."""

    code: str
    kind: OriginKind = "execution"
    session_id: str = ""
    origin: str = ""  # its token: made from its kind when not given
    deadline: float | None = None  # time.monotonic() at its time limit
    margin_s: float = EXECUTION_MARGIN_S
    waiting: set[str] = field(default_factory=set)  # request ids
    waits_end_at: float | None = None  # time.time() by which its calls' waits must end
    outcomes: list[ApprovalOutcome] = field(default_factory=list)
    more: int = 0  # outcomes past approvals.MAX_NOTED, counted only
    shared: bool = False  # written to the shared store while it runs

    def __post_init__(self) -> None:
        if not self.origin:
            self.origin = make_origin(self.kind)

    def environment(self, env: dict[str, str] | None) -> dict[str, str]:
        """`env` with this origin in it, last: a caller's variables cannot move it."""
        return {**(env or {}), TOOL_ORIGIN_ENV: self.origin}


@dataclass(frozen=True)
class Caller:
    """The running origin a call names: its entry here, or None when another replica runs it
    (found in the shared store); `waits_end_at`: time.time() by which a wait for an approval of
    its call must end (its time limit, less a margin), or None."""

    kind: OriginKind
    code: str
    entry: RunningCode | None
    waits_end_at: float | None = None


class SharedOrigins(Protocol):
    """The shared store's origins (orchestrator/governance/stores/redis_origins.py)."""

    async def put_origin(
        self, session_id: str, origin: str, record: OriginRecord, ttl_s: float
    ) -> None: ...

    async def get_origin(self, session_id: str, origin: str) -> OriginRecord | None: ...

    async def delete_origin(self, session_id: str, origin: str) -> None: ...

    async def refresh_origins(self, origins: list[tuple[str, str]], ttl_s: float) -> None:
        """Renew the time to live of each (session id, origin) still there."""


class CallOrigins:
    """The origins running on this replica, by session; `shared_of()`: the shared store's
    origins, or None (one replica: nothing to share)."""

    def __init__(
        self,
        shared_of: Callable[[], SharedOrigins | None] = lambda: None,
        on_end: Callable[[RunningCode], None] = lambda _: None,
        *,
        shared_ttl_s: float = SHARED_TTL_S,
        shared_refresh_s: float = SHARED_REFRESH_S,
    ) -> None:
        """`on_end(entry)`: told when an origin ends (its waits are abandoned there)."""
        self._shared_of = shared_of
        self._on_end = on_end
        self._ttl_s, self._refresh_s = shared_ttl_s, shared_refresh_s
        self._live: dict[str, dict[str, RunningCode]] = {}  # session id -> origin -> entry
        self._tasks: set[asyncio.Task[None]] = set()  # followers and shared deletes
        self._followers: dict[str, set[asyncio.Task[None]]] = {}  # session id -> its followers
        self._refresher: asyncio.Task[None] | None = None  # renews the shared ones' time to live
        # In the tokens made here: what this replica knows of them is the truth (one that
        # ended here is not looked for in the store, whose copy may not be deleted yet).
        self._replica = secrets.token_hex(3)

    async def open(
        self,
        session_id: str,
        kind: OriginKind,
        code: str,
        timeout_s: float | None = None,
        *,
        shared: bool = False,
    ) -> RunningCode:
        """An origin that runs from now on, until `end`; `shared`: also in the shared store
        (a session with host tools), written before this returns."""
        entry = RunningCode(code, kind, session_id, make_origin(kind, self._replica))
        if timeout_s is not None:
            entry.deadline = time.monotonic() + timeout_s
            entry.margin_s = min(EXECUTION_MARGIN_S, timeout_s / 5)
            entry.waits_end_at = time.time() + timeout_s - entry.margin_s
        self._live.setdefault(session_id, {})[entry.origin] = entry
        store = self._shared_of() if shared else None
        if store is None:
            return entry
        record = OriginRecord(kind=kind, code=code, waits_end_at=entry.waits_end_at)
        put = asyncio.ensure_future(store.put_origin(session_id, entry.origin, record, self._ttl_s))
        try:
            await asyncio.shield(put)
        except Exception as exc:  # its calls are then refused by other replicas only
            log.warning("session %s: %s not shared: %s", session_id, entry.origin, exc)
        except BaseException:  # cancelled: it never runs; once written, it is deleted
            self.end(entry)
            self._spawn(self._delete_once_written(put, store, session_id, entry.origin))
            raise
        else:
            entry.shared = True
            if self._live.get(session_id, {}).get(entry.origin) is not entry:  # ended meanwhile
                self._spawn(store.delete_origin(session_id, entry.origin))
            else:
                self._keep_refreshing()
        return entry

    @staticmethod
    async def _delete_once_written(
        put: asyncio.Future[None], store: SharedOrigins, session_id: str, origin: str
    ) -> None:
        with contextlib.suppress(Exception):
            await put
        await store.delete_origin(session_id, origin)

    def _keep_refreshing(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.ensure_future(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        """Renew the shared origins' time to live while any runs here (a failure is logged:
        they expire, and other replicas refuse their calls, until the store answers again)."""
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                if not await self.refresh():
                    return  # none left: the next shared one starts this again
            except Exception as exc:
                log.warning("the shared origins' time to live could not be renewed: %s", exc)

    async def refresh(self) -> int:
        """Renew the time to live of every origin shared from here now; how many there are."""
        shared = [
            (entry.session_id, entry.origin)
            for entries in self._live.values()
            for entry in entries.values()
            if entry.shared
        ]
        store = self._shared_of() if shared else None
        if store is not None:
            await store.refresh_origins(shared, self._ttl_s)
        return len(shared)

    def end(self, entry: RunningCode) -> None:
        """The origin ended: its calls are refused from now on."""
        entries = self._live.get(entry.session_id)
        if entries is None or entries.pop(entry.origin, None) is None:
            return
        if not entries:
            del self._live[entry.session_id]
        self._on_end(entry)
        store = self._shared_of() if entry.shared else None
        if store is not None:  # a task, not awaited: an end must not wait on the store
            self._spawn(store.delete_origin(entry.session_id, entry.origin))

    def end_after(self, entry: RunningCode, ended: Awaitable[object]) -> None:
        """End `entry` once `ended` is done (a background process's end), or its session."""

        async def follow() -> None:
            try:
                await ended
            finally:
                self.end(entry)

        task = self._spawn(follow())
        followers = self._followers.setdefault(entry.session_id, set())
        followers.add(task)

        def done(_: asyncio.Task[None]) -> None:
            followers.discard(task)
            if not followers and self._followers.get(entry.session_id) is followers:
                del self._followers[entry.session_id]

        task.add_done_callback(done)

    def forget_session(self, session_id: str) -> None:
        """The session ended: every origin of its ends now, and nothing waits on its processes."""
        for entry in list(self._live.get(session_id, {}).values()):
            self.end(entry)
        for task in list(self._followers.get(session_id, ())):
            task.cancel()

    async def caller(self, session_id: str, origin: str | None) -> Caller | None:
        """The running origin `origin` names in the session, or None (ended, unknown, none)."""
        if origin is None:
            return None
        entry = self._live.get(session_id, {}).get(origin)
        if entry is not None:
            return Caller(entry.kind, entry.code, entry, entry.waits_end_at)
        store = self._shared_of()
        mine = origin.partition("-")[2].startswith(self._replica)
        if store is None or mine or kind_of(origin) is None:
            return None
        try:
            record = await store.get_origin(session_id, origin)
        except Exception as exc:  # not found is not running: never run a call unchecked
            log.warning("session %s: origin %s could not be read: %s", session_id, origin, exc)
            return None
        if record is None:
            return None
        return Caller(record.kind, record.code, None, record.waits_end_at)

    def _spawn(self, work: Awaitable[object]) -> asyncio.Task[None]:
        async def run() -> None:
            with contextlib.suppress(Exception):
                await work

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._refresher] if self._refresher is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
