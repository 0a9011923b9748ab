"""Every attack runs beside a bystander session that must not notice it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandbox import Backend, Sandbox
from tests.conftest import small_spec


@pytest.fixture
async def bystander(backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await backend.create(small_spec())
    await sb.execute("canary = 'untouched'")
    yield sb
    after = await sb.execute("canary")
    assert after.text == "'untouched'", "the bystander session was affected"
    await sb.close()
