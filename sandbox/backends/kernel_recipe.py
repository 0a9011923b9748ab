"""The one recipe by which the local and Docker backends make a kernel sandbox.

In order: the session's directories (and the host uid it runs as), what the backend prepares
beside them (a cgroup, a user database), the channels the sandbox reaches the host by (host
tools, egress), Python's kernel started and answering, then the sandbox. If any step fails or
is cancelled, everything the earlier steps made is undone, alike in every backend: the kernel's
driver closed, the directories removed, the backend's own resources given back.

A backend says only what differs, as the hooks of its `KernelRecipe`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.egress_channel import EgressChannel
from sandbox.host_channel import HostChannel
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.process import KernelLauncher
from sandbox.run_to_end import finish_even_if_cancelled
from sandbox.socket_peer import SocketPeer
from sandbox.state_dir import SessionDirs

log = logging.getLogger(__name__)

S = TypeVar("S", bound=KernelSandbox)


@dataclass(frozen=True)
class ChannelPeer:
    """Who connects to a sandbox's channels, as the host sees it: the kernel's uid and gid, and
    the program where the uid alone does not say it (gVisor's gofer connects as root)."""

    uid: int
    gid: int
    program: str | None = None


class KernelRecipe(ABC, Generic[S]):
    """The making of one kernel sandbox; `make()` runs the recipe, the hooks fill it in."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.sandbox_id = secrets.token_hex(8)
        self.host_channel: HostChannel | None = None
        self.egress_channel: EgressChannel | None = None

    async def make(self) -> S:
        """Run the recipe: the sandbox, its Python kernel answering; on failure nothing is left."""
        dirs: SessionDirs | None = None
        driver: KernelDriver | None = None
        try:
            # Made whole even when this make is cancelled meanwhile (a pool closing cancels its
            # starts), so that what was made is known, and removed below.
            making = asyncio.ensure_future(self.make_dirs())
            try:
                dirs = await finish_even_if_cancelled(making)
            except asyncio.CancelledError:
                if not making.cancelled() and making.exception() is None:
                    dirs = making.result()
                raise
            await self.prepare(dirs)
            self.make_channels(dirs)
            driver = self.driver(PYTHON)
            await driver.start()
            sandbox = self.sandbox(dirs, driver)
        except BaseException:  # undone whole, even if cancelled again meanwhile
            try:
                await finish_even_if_cancelled(self._undo_all(driver, dirs))
            except Exception:  # what made it fail is what the caller is told
                log.exception("undoing a sandbox that did not start failed")
            raise
        sandbox.host_channel = self.host_channel
        sandbox.egress_channel = self.egress_channel
        return sandbox

    async def _undo_all(self, driver: KernelDriver | None, dirs: SessionDirs | None) -> None:
        """Each step, whatever the one before it raised."""
        try:
            if driver is not None:
                await driver.close()
        finally:
            try:
                if dirs is not None:
                    await asyncio.to_thread(dirs.remove)
            finally:
                await self.undo()

    def make_channels(self, dirs: SessionDirs) -> None:
        """The host-tool and egress channels' directories, where the spec asks for them (once:
        a backend that binds them into its sandbox makes them in `prepare`)."""
        peer = self.channel_peer()
        if self.spec.host_tools and self.host_channel is None:
            self.host_channel = HostChannel.create(
                dirs.host_tools, peer_uid=peer.uid, peer_gid=peer.gid, peer_program=peer.program
            )
        if self.wants_egress() and self.egress_channel is None:
            self.egress_channel = EgressChannel.create(
                dirs.egress, peer=SocketPeer(peer.uid, peer.program), peer_gid=peer.gid
            )

    def driver(self, language: str) -> KernelDriver:
        """A driver for the sandbox's kernel of `language` (Python's at first, the others on
        their first use: `KernelSandbox(make_driver=...)`)."""
        return KernelDriver.for_spec(self.launcher(language), self.spec, language)

    def wants_egress(self) -> bool:
        """Whether the sandbox gets an egress channel: when its policy lets it reach out."""
        return self.spec.network.enabled

    # --- the hooks ---------------------------------------------------------------------------

    @abstractmethod
    async def make_dirs(self) -> SessionDirs:
        """The session's directories (`SessionDirs.create`), and whatever comes first (its
        host uid); what it took is given back by `undo`, even when this fails."""

    async def prepare(self, dirs: SessionDirs) -> None:
        """What the backend makes beside the directories before the kernel starts (given back
        by `undo`)."""

    @abstractmethod
    def channel_peer(self) -> ChannelPeer:
        """Who the channels let connect."""

    @abstractmethod
    def launcher(self, language: str) -> KernelLauncher:
        """What starts the kernel of `language` in this sandbox."""

    @abstractmethod
    def sandbox(self, dirs: SessionDirs, driver: KernelDriver) -> S:
        """The sandbox, once its Python kernel answers."""

    @abstractmethod
    async def undo(self) -> None:
        """Give back what `make_dirs` and `prepare` took beyond the directories (the recipe
        removes those): called once, whatever step failed, so only what was taken."""
