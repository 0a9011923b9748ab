"""Integration fixtures: a CodeSession per backend, made the way a user makes one."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from orchestrator.integrations.code_session import CodeSession
from tests.conftest import SELECTED, backend_config, backend_unavailable, small_spec


@pytest.fixture(params=SELECTED)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    why = backend_unavailable(name)
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the {name} backend must run in CI: {why}")
        pytest.skip(f"{name} backend unavailable: {why}")
    return name


@pytest.fixture
async def code_session(backend_name: str) -> AsyncIterator[CodeSession]:
    session = CodeSession.embedded(backend_name, small_spec(), **backend_config(backend_name))
    try:
        yield session
    finally:
        await session.close()
