"""Names a key may not take: those the service's own events and the settings' keys carry, so a
filter by name (`audit list --key`, `GET /v1/audit?key=`) never mixes a key's events with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["local", "service", "key-0123abcd", "_under", "a" * 65, ""])
def test_a_reserved_or_malformed_name_is_refused(tmp_path: Path, name: str) -> None:
    made = CliRunner().invoke(cli_app, ["keys", "add", name, "--state-dir", str(tmp_path)])
    assert made.exit_code == 2, made.stdout
    assert "cannot name a key" in made.stderr


def test_a_plain_name_is_taken(tmp_path: Path) -> None:
    made = CliRunner().invoke(cli_app, ["keys", "add", "services", "--state-dir", str(tmp_path)])
    assert made.exit_code == 0, made.stderr
    assert made.stdout.strip().startswith("cir_")
