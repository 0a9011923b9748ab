"""A sandbox with several languages: the host's kernels (local), the full image (Docker)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

from sandbox import Backend, Sandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec


@contextlib.asynccontextmanager
async def polyglot_sandbox(backend: Backend, languages: Iterable[str]) -> AsyncIterator[Sandbox]:
    """A sandbox that has every one of `languages` (the test fails if one is missing)."""
    spec = small_spec(image=FULL_IMAGE) if backend.capabilities.images else small_spec()
    sb = await backend.create(spec)
    try:
        missing = set(languages) - set(sb.languages)
        assert not missing, f"the {backend.name} sandbox lacks {missing}: {sb.languages}"
        yield sb
    finally:
        await sb.close()
