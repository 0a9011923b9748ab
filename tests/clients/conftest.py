"""Integration fixtures: a CodeSession per backend, made the way a user makes one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from code_interpreter_client.code_session import CodeSession
from tests.conftest import SELECTED, backend_config, require_backend, small_spec


@pytest.fixture(params=SELECTED)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_backend(name)
    return name


@pytest.fixture
async def code_session(backend_name: str) -> AsyncIterator[CodeSession]:
    session = CodeSession.embedded(backend_name, small_spec(), **backend_config(backend_name))
    try:
        yield session
    finally:
        await session.close()
