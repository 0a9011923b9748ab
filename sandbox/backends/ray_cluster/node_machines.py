"""The session actor's whole-machine saves, where its node's backend makes them (a gVisor
node's: `CIR_NODE_BACKEND=gvisor`): a pause or a snapshot saves the machine on the node, and
the replica carries the image to the shared store (machine_store.py) a batch at a time, from
which any node able to restore it does (`receive_tree`, then `start_restored`).

A pause stops the machine before its image has left the node: until the replica says the image
is safe (`paused_away`), calls are refused as during any pause (`SandboxPausing`), and if the
carrying fails (`wake_here`) or no replica follows up within `FENCE_S` (it died), the machine
is woken again here from its image, so a failed pause loses nothing and the session runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import ray

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.machine_store import tree_batches
from sandbox.saved_report import SavedState
from sandbox.tree_transfer import TreeEntry, TreeWriter

if TYPE_CHECKING:
    from sandbox.backends.base import Backend, Sandbox

log = logging.getLogger(__name__)

PAUSING_WHY = "the session is being paused; resume it once it is"
TREE_BATCHES_UNREAD = 2  # batches of a tree the actor may be ahead of its reader


class MachineWokeAgain(SandboxError):
    """A pause's image was carried too late: the machine already ran again on its node."""


class NodeMachines:
    """Mixin of the session actor: its machine saved whole on this node, carried away, and a
    machine carried here restored."""

    _paused_here: Path | None = None  # a paused machine's image, until it is safe elsewhere
    _paused_away = False  # the replica has the image: a lapse ends the actor, never wakes it
    _lapse_s = 60.0  # how long a paused image waits for its replica's next step
    _pausing: asyncio.Lock | None = None  # one step of a whole pause at a time
    _suspending = False  # the machine is being saved for a pause
    # Replaced whole, never changed in place: the defaults are shared by every actor.
    _saves: Mapping[str, Path] = MappingProxyType({})  # token -> a snapshot saved here, unsent
    _received: Mapping[str, tuple[TreeWriter, Path]] = MappingProxyType({})  # token -> incoming

    if TYPE_CHECKING:  # given by the actor this is mixed into
        sandbox: Sandbox
        spec: SandboxSpec
        _backend: Backend | None
        _changing: int
        _fenced: str | None
        _fence_lapses: asyncio.TimerHandle | None

        async def _staging_dir(self) -> Path: ...
        async def open_tool_relay(self) -> None: ...
        async def reopen_tool_relay(self) -> None: ...
        def _unfence(self) -> None: ...

    def whole_saves(self) -> bool:
        """Whether this node's backend saves and restores whole machines."""
        from sandbox.backends.ray_cluster.names import node_backend_name
        from sandbox.backends.registry import backend_type

        return backend_type(node_backend_name()).capabilities.suspend

    # --- a pause ----------------------------------------------------------------------------

    async def suspend_here(self, lapse_s: float) -> str | None:
        """Save the machine whole and stop it, its image kept on this node for the replica to
        carry away (`send_paused`); None where it cannot be saved so (what it holds, or calls
        that may change it still in flight): the replica then saves the kernel's state, and
        the machine runs on. Calls from every replica are refused from the start (before the
        save, so none changes what is saved). `lapse_s`: how long the image waits for the
        replica's next step (each batch carried counts as one)."""
        async with self._pause_lock():  # taken first: the fence goes up with no await after
            backend = self._backend
            if backend is None or self._fenced is not None or self._changing:
                return None
            if getattr(self, "_closed", False) or self.holds_a_pause():
                return None
            self._fenced = PAUSING_WHY
            self._suspending = True
            try:
                handle = await self.sandbox.suspend()
                if handle is None:
                    self._unfence()
                    return None
                self._lapse_s = lapse_s
                self._fence(PAUSING_WHY, lapse_s)
                held = await self._staging_dir() / f"paused-{secrets.token_hex(8)}"
            except BaseException:
                self._unfence()
                raise
            finally:
                self._suspending = False
            try:
                await backend.take_suspended(handle, held)
            except BaseException:
                try:
                    await self._woken(await backend.wake(handle, self.spec))
                except BaseException:
                    await self._end_unwoken()
                    raise
                raise
            self._paused_here = held
            return held.name

    async def _end_unwoken(self) -> None:
        """The paused machine cannot run again: the session ends here, so its calls are
        answered as closed, never by a stopped machine."""
        log.exception("a paused machine could not be woken again on its node: the session ends")
        await self._shut_down()  # type: ignore[attr-defined]

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=TREE_BATCHES_UNREAD)
    async def send_paused(self, max_bytes: int) -> AsyncIterator[list[TreeEntry]]:
        """The paused machine's image, in batches (a streaming call: see session_actor.py)."""
        held = self._paused_here
        if held is None:
            raise SandboxError("no paused machine is held on this node")
        async for batch in tree_batches(held, max_bytes):
            if self._paused_here is not held:
                raise SandboxError("the paused machine was woken again on its node")
            self._fence(PAUSING_WHY, self._lapse_s)  # carried on: the lapse counts again
            yield batch
        if self._paused_here is held:  # all sent: the replica's writing it out counts afresh
            self._fence(PAUSING_WHY, self._lapse_s)

    async def paused_away(self) -> None:
        """The image is safe elsewhere: its copy here goes; the actor waits to be closed (if
        no replica closes it within the lapse, it ends itself). Refused if the machine was
        woken here meanwhile (the lapse): the session runs on here, not paused."""
        async with self._pause_lock():
            if self._paused_here is None and not self._paused_away:
                raise MachineWokeAgain(
                    "the machine was woken again on its node before its image was safe: the "
                    "session runs on there; pause it again"
                )
            self._paused_away = True
            held, self._paused_here = self._paused_here, None
            if held is not None:
                await asyncio.to_thread(shutil.rmtree, held, True)

    async def wake_here(self) -> None:
        """The image could not be carried away: the machine runs again here, as it was. Once
        only, however many ask (the replica and the lapse)."""
        async with self._pause_lock():
            held = self._paused_here
            if held is None or self._paused_away:
                if not self._paused_away:
                    self._unfence()  # nothing is paused here: calls go on
                return
            try:
                woken = await self._backend_or_fail().wake_from(held, self.spec)
            except BaseException:
                await self._end_unwoken()
                raise
            self._paused_here = None  # first: a batch still being sent stops, never fences
            await self._woken(woken)
            await asyncio.to_thread(shutil.rmtree, held, True)

    def holds_a_pause(self) -> bool:
        """Whether a whole pause holds the machine (being saved, stopped here, or carried
        away): no other fence or unfence touches it then."""
        return self._suspending or self._paused_here is not None or self._paused_away

    async def _woken(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._unfence()
        try:
            await self.reopen_tool_relay()
        except Exception:
            log.exception("the woken machine's host-tool channel could not be opened again")

    def _pause_lock(self) -> asyncio.Lock:
        if self._pausing is None:
            self._pausing = asyncio.Lock()
        return self._pausing

    def _fence(self, why: str, lapse_s: float) -> None:
        self._fenced = why
        if self._fence_lapses is not None:
            self._fence_lapses.cancel()
        self._fence_lapses = asyncio.get_running_loop().call_later(lapse_s, self._lapsed)

    def _lapsed(self) -> None:
        """No replica followed the pause up: woken again here (the image never left), or
        ended (it did: the session is paused in the store)."""
        self._fence_lapses = None
        self._lapse_task = asyncio.ensure_future(self._after_lapse())

    async def _after_lapse(self) -> None:
        if self._paused_away:
            log.warning("a paused session's actor was never closed by its replica: ending it")
            await self._shut_down()  # type: ignore[attr-defined]
            with contextlib.suppress(Exception):  # its own handle: the slot goes back
                me = ray.get_runtime_context().current_actor
                await asyncio.to_thread(ray.kill, me, no_restart=True)
            return
        try:
            log.warning("a pause was never finished by its replica: the machine runs again")
            await self.wake_here()
        except Exception:
            log.exception("a paused machine could not be woken again on its node")

    # --- a snapshot -------------------------------------------------------------------------

    async def save_whole_here(self, max_bytes: int) -> tuple[str, SavedState] | None:
        """Save the machine whole on this node and run on; (its token for `send_save`, what
        was saved), or None where it cannot be saved so."""
        for earlier in self._saves.values():  # never taken (its replica left): gone now
            await asyncio.to_thread(shutil.rmtree, earlier, True)
        self._saves = {}
        staged = await self._staging_dir() / f"save-{secrets.token_hex(8)}"
        state = await self.sandbox.save_whole(staged, max_bytes=max_bytes)
        if state is None:
            return None
        self._saves = {**self._saves, staged.name: staged}
        return staged.name, state

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=TREE_BATCHES_UNREAD)
    async def send_save(self, token: str, max_bytes: int) -> AsyncIterator[list[TreeEntry]]:
        """A snapshot saved here, in batches; its copy here goes once sent, or left."""
        staged = self._saves.get(token)
        if staged is None:
            raise SandboxError("no such saved machine on this node")
        try:
            async for batch in tree_batches(staged, max_bytes):
                yield batch
        finally:
            self._saves = {k: v for k, v in self._saves.items() if k != token}
            await asyncio.to_thread(shutil.rmtree, staged, True)

    # --- a machine carried here -------------------------------------------------------------

    async def receive_open(self, max_bytes: int) -> str:
        """Begin receiving a saved machine's tree: its token for `receive_tree`."""
        token = f"received-{secrets.token_hex(8)}"
        dest = await self._staging_dir() / token
        writer = await asyncio.to_thread(TreeWriter, dest, max_bytes=max_bytes)
        self._received = {**self._received, token: (writer, dest)}
        return token

    async def receive_tree(self, token: str, batch: list[TreeEntry]) -> None:
        writer, _ = self._receiving(token)
        try:
            await asyncio.to_thread(writer.write, batch)
        except BaseException:
            await self._drop_received(token)
            raise

    async def start_restored(self, token: str, how: str) -> object:
        """Start this session's sandbox from the machine received under `token`: woken as it
        was (`how="wake"`, a paused session), or a fork of a snapshot, re-keyed (`"fork"`).
        The received copy goes either way."""
        writer, dest = self._receiving(token)
        try:
            await asyncio.to_thread(writer.finish)
            return await self.start(restore=(dest, how))  # type: ignore[attr-defined]
        finally:
            await self._drop_received(token)

    def _receiving(self, token: str) -> tuple[TreeWriter, Path]:
        found = self._received.get(token)
        if found is None:
            raise SandboxError("no such machine being received on this node")
        return found

    async def _drop_received(self, token: str) -> None:
        found = self._received.get(token)
        self._received = {k: v for k, v in self._received.items() if k != token}
        if found is not None:
            await asyncio.to_thread(found[0].abort)

    async def drop_machines(self) -> None:
        """At close: whatever of a saved machine is still kept on this node goes."""
        for _, dest in self._received.values():
            await asyncio.to_thread(shutil.rmtree, dest, True)
        for staged in self._saves.values():
            await asyncio.to_thread(shutil.rmtree, staged, True)
        if self._paused_here is not None:
            await asyncio.to_thread(shutil.rmtree, self._paused_here, True)
        self._received, self._saves, self._paused_here = {}, {}, None

    def _backend_or_fail(self) -> Backend:
        if self._backend is None:
            raise SandboxError("the session's sandbox was never started")
        return self._backend
