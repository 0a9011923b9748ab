"""`code-interpreter audit` finds the audit log where the service's settings say, as `keys`
does: the config file's state dir, or its shared store under its key prefix, with no option and
no environment variable naming them. A key added by `keys` is read back by `audit`."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app


def settings_in_a_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, settings: dict[str, str]
) -> None:
    """The service's settings in its config file alone: no CODE_INTERPRETER_* variable."""
    for name in list(os.environ):
        if name.startswith("CODE_INTERPRETER_"):
            monkeypatch.delenv(name)
    config = tmp_path / "code-interpreter.toml"
    lines = [f"{name} = {json.dumps(value)}\n" for name, value in settings.items()]
    config.write_text("".join(lines))
    monkeypatch.setenv("CODE_INTERPRETER_CONFIG", str(config))


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("where", ["state_dir", "store"])
def test_audit_reads_where_the_config_file_says_as_keys_writes(
    where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    state = tmp_path / "state"
    settings = {"state_dir": str(state)}
    if where == "store":
        url = request.getfixturevalue("redis_url")
        settings |= {"store_url": url, "store_prefix": f"p{uuid.uuid4().hex[:8]}"}
    settings_in_a_config_file(monkeypatch, tmp_path, settings)
    name = f"configured-{uuid.uuid4().hex[:8]}"
    code, _, stderr = run("keys", "add", name)
    assert code == 0, stderr
    code, stdout, stderr = run("audit", "list", "--json", "--kind", "key.added")
    assert code == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert [e["principal"] for e in events] == [name], events
    if where == "store":  # in the store, not in a state dir
        assert not (state / "state.db").exists()
