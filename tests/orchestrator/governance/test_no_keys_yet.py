"""A service with auth on and no key at all yet starts (its store can hold keys the CLI makes),
says how to add one (in its log, and in its 401s), and takes the first key the CLI adds
without a restart. In this process: a real service and store, the CLI's own code."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from fastapi import HTTPException
from typer.testing import CliRunner

from orchestrator.auth import Authenticator
from orchestrator.cli import app as cli_app
from orchestrator.config import Settings
from orchestrator.service import Service


def test_settings_without_keys_are_valid_with_auth_on(state_dir: Path) -> None:
    settings = Settings(state_dir=state_dir)
    assert settings.api_keys == [] and settings.admin_keys == []
    assert settings.auth_disabled is False


async def test_a_service_without_keys_starts_says_how_to_add_one_and_takes_it(
    state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(state_dir=state_dir, backends=["local"], default_backend="local")
    service = Service(settings)
    authenticate = Authenticator(settings, lambda: service.admission.principals)
    with caplog.at_level(logging.WARNING):
        await service.start()
    try:
        assert "code-interpreter keys add" in caplog.text, caplog.text
        with pytest.raises(HTTPException) as caught:
            authenticate.principal_for_key("anything")
        assert caught.value.status_code == 401
        assert "code-interpreter keys add" in str(caught.value.detail)

        made = await asyncio.to_thread(
            CliRunner().invoke,
            cli_app,
            ["keys", "add", "first-admin", "--admin", "--state-dir", str(state_dir)],
        )
        assert made.exit_code == 0, made.stderr
        key = made.stdout.strip()
        await service.admission.principals.reload()  # as its refresh does within 1 s
        found = authenticate.principal_for_key(key)
        assert found.name == "first-admin" and found.admin
        with pytest.raises(HTTPException) as caught:
            authenticate.principal_for_key("anything")
        assert "keys add" not in str(caught.value.detail)  # keys exist: the plain refusal
    finally:
        await service.close()
