"""The `keys` and `audit` commands as an operator meets them when something is off: a store that
does not answer, a state dir that is not the service's (a typo). Each says what
is wrong in one line and exits 2; none prints a traceback or makes a stray database."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app

UNREACHABLE = "redis://:pw@127.0.0.1:1/0"  # loopback, a port nothing listens on


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["keys", "list"],
        ["keys", "add", "someone"],
        ["audit", "list"],
        ["audit", "prune", "--older-than", "30d"],
    ],
)
def test_a_store_that_does_not_answer_is_one_line(command: list[str]) -> None:
    code, _, stderr = run(*command, "--store", UNREACHABLE)
    assert code == 2
    [line] = stderr.strip().splitlines()
    assert line.startswith("error: ") and "127.0.0.1:1" in line and "Traceback" not in line


@pytest.mark.parametrize(
    "command",
    [
        ["keys", "list"],
        ["keys", "show", "someone"],
        ["keys", "revoke", "someone"],
        ["keys", "rotate", "someone"],
        ["audit", "list"],
    ],
)
def test_a_state_dir_without_the_service_s_state_is_refused(
    command: list[str], tmp_path: Path
) -> None:
    typo = tmp_path / "sate"
    code, _, stderr = run(*command, "--state-dir", str(typo))
    assert code == 2
    assert f"no service state in {typo}" in stderr and "--state-dir" in stderr
    assert not typo.exists()  # nothing made where nothing was


def test_a_first_key_may_be_added_before_the_service_ever_ran(tmp_path: Path) -> None:
    fresh = tmp_path / "state"
    code, stdout, stderr = run("keys", "add", "first", "--state-dir", str(fresh))
    assert code == 0, stderr
    assert stdout.strip().startswith("cir_") and (fresh / "state.db").is_file()
    assert f"made {fresh / 'state.db'}" in stderr  # said, in case the path was a typo
    code, stdout, _ = run("keys", "list", "--state-dir", str(fresh))
    assert code == 0 and "first" in stdout


def test_a_time_that_is_none_says_every_form_the_option_takes(tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path)]
    assert run("keys", "add", "first", *state)[0] == 0
    code, _, stderr = run("audit", "list", "--since", "yesterday", *state)
    assert code == 2
    assert "ISO 8601" in stderr and "epoch" in stderr and "an age (2h" in stderr
    assert run("audit", "list", "--since", "2h", *state)[0] == 0
