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
        if not handle.startswith(PAUSED_PREFIX) or not token.replace("-", "").isalnum():
            raise SandboxError(f"{handle!r} names no paused machine of the ray backend")
        return self.root / token

    @staticmethod
    def handle_of(token: str) -> str:
        return f"{PAUSED_PREFIX}{token}"

    @staticmethod
    def is_handle(handle: str) -> bool:
        return handle.startswith(PAUSED_PREFIX)

    async def discard(self, handle: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self.path(handle), True)


def machine_store(root: Path | None) -> MachineStore | None:
    """The store at `root` (the ray backend's `machine_images_dir`); None: there is none."""
    return MachineStore(root) if root is not None else None


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
    making = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.new")
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
