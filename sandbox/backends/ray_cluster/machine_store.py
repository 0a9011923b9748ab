"""Where a paused Ray session's whole machine waits: a directory every replica mounts (the
service's `saved_states_dir`, which it already needs for ray sessions' saved states), one
subdirectory per paused machine, named by the token its pause gave. A replica carries the image
there from the node that paused it, and from there to the node that wakes it; nothing of it
stays on a node meanwhile, so a paused session outlives its node and resumes on any node whose
backend restores machines (docs/cluster.md).

Snapshots of whole machines are kept by the service's own saved-state store (it gives the
directory to `save_whole` and `fork`); only the carrying is shared, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.spec import SandboxSpec
from sandbox.tree_transfer import TreeEntry, TreeWriter, read_tree

PAUSED_PREFIX = "machine-"  # a paused machine's handle: this and its token
IMAGE_SLACK_MB = 512  # what a machine's image may hold beyond its memory and workspace
PARTIAL_SUFFIX = ".new"  # an image being carried in: `.<token>.<random><suffix>`, then renamed
FROM_SUFFIX = ".from"  # `.<token><suffix>`: the sandbox a machine was paused from (`_tag`)
_TOKEN = re.compile(r"[A-Za-z0-9-]+")  # what `path` accepts of a handle's token
_MAX_TAG = 512


def image_cap(spec: SandboxSpec) -> int:
    """The most a saved machine of `spec` may take to carry: its memory and its workspace,
    and room for what gVisor keeps besides."""
    return (spec.limits.memory_mb + spec.limits.workspace_size_mb + IMAGE_SLACK_MB) << 20


class MachineStore:
    """The shared directory of paused machines."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, handle: str) -> Path:
        token = handle.removeprefix(PAUSED_PREFIX)
        if not handle.startswith(PAUSED_PREFIX) or not _TOKEN.fullmatch(token):
            raise SandboxError(f"{handle!r} names no paused machine of the ray backend")
        return self.root / token

    @staticmethod
    def handle_of(token: str) -> str:
        return f"{PAUSED_PREFIX}{token}"

    @staticmethod
    def is_handle(handle: str) -> bool:
        return handle.startswith(PAUSED_PREFIX)

    async def discard(self, handle: str) -> None:
        path = self.path(handle)
        await asyncio.to_thread(shutil.rmtree, path, True)
        await asyncio.to_thread(self._tag(path).unlink, True)

    @staticmethod
    def _tag(path: Path) -> Path:
        """Beside an image (never in it: it travels whole): the sandbox it was paused from."""
        return path.with_name(f".{path.name}{FROM_SUFFIX}")

    async def mark_paused_from(self, handle: str, sandbox_handle: str) -> None:
        """Say which sandbox the machine was paused from: while a session's record names that
        sandbox, the image is its session's (even before its record names the image: a
        pause whose record could not be written) and the orphan sweep leaves it."""
        await asyncio.to_thread(self._tag(self.path(handle)).write_text, sandbox_handle)

    async def paused_from(self, handles: set[str]) -> dict[str, str]:
        """The sandbox each of these machines was paused from, where it is known."""
        return await asyncio.to_thread(self._paused_from, handles)

    def _paused_from(self, handles: set[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for handle in handles:
            if not self.is_handle(handle):
                continue
            with contextlib.suppress(OSError, SandboxError, UnicodeDecodeError):
                found[handle] = self._tag(self.path(handle)).read_text()[:_MAX_TAG].strip()
        return found

    async def stored(self) -> list[str]:
        """The handles of the machines waiting here, whole (one being carried in is not yet):
        the orphan sweep asks which a record names; an image whose pause died before its
        record was written is named by none."""
        return await asyncio.to_thread(self._stored)

    def _entries(self) -> list[Path]:
        """What the store's directory holds (nothing before the first pause made it)."""
        try:
            return list(self.root.iterdir())
        except FileNotFoundError:
            return []

    def _stored(self) -> list[str]:
        return sorted(
            self.handle_of(entry.name)
            for entry in self._entries()
            if _TOKEN.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()
        )

    async def remove_partials(self, untouched_since: float) -> int:
        """Remove the images a replica killed while carrying them in left half made (see
        `receive_tree`), untouched since `untouched_since` (a Unix time): no carrying lasts
        that long. How many."""
        return await asyncio.to_thread(self._remove_partials, untouched_since)

    def _remove_partials(self, untouched_since: float) -> int:
        removed = 0
        for entry in self._entries():
            if not (entry.name.startswith(".") and entry.name.endswith(PARTIAL_SUFFIX)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if _newest_change(entry) < untouched_since:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink()
                    removed += 1
        return removed


def machine_store(root: Path | None) -> MachineStore | None:
    """The store at `root` (the ray backend's `machine_images_dir`); None: there is none."""
    return MachineStore(root) if root is not None else None


def _newest_change(path: Path) -> float:
    """When anything in the tree at `path` last changed (a large file deep inside is written
    long after its directory was made)."""
    newest = path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


async def receive_tree(
    batches: AsyncIterator[Any],
    dest: Path,
    *,
    max_bytes: int,
    take: Callable[[Any], Awaitable[Any]],
) -> None:
    """Write the tree a node sends (each item of `batches` a ref `take` turns into a batch)
    into `dest`, made apart and renamed into place once whole: a reader never finds half of
    it. Nothing of it is left if it fails."""
    await asyncio.to_thread(dest.parent.mkdir, mode=0o700, parents=True, exist_ok=True)
    making = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
    writer = await asyncio.to_thread(TreeWriter, making, max_bytes=max_bytes)
    try:
        async for ref in batches:
            batch: list[TreeEntry] = await take(ref)
            await asyncio.to_thread(writer.write, batch)
        await asyncio.to_thread(writer.finish)
        await asyncio.to_thread(_rename_into_place, making, dest)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise


def _rename_into_place(making: Path, dest: Path) -> None:
    """`making` becomes `dest`; an empty `dest` (made by the caller, as a saved-state store
    does) is replaced."""
    with contextlib.suppress(FileNotFoundError, OSError):
        dest.rmdir()  # only if empty
    making.rename(dest)


async def tree_batches(root: Path, max_bytes: int) -> AsyncIterator[list[TreeEntry]]:
    """`read_tree` of `root`, each batch read on a thread (a disk may be slow)."""
    batches = read_tree(root, max_bytes=max_bytes)
    done: Any = object()
    while (batch := await asyncio.to_thread(next, batches, done)) is not done:
        yield batch


async def send_tree(
    root: Path, *, max_bytes: int, send: Callable[[list[TreeEntry]], Awaitable[None]]
) -> None:
    """Send the tree under `root` a batch at a time (`send` awaits each: one in flight)."""
    async for batch in tree_batches(root, max_bytes):
        await send(batch)
