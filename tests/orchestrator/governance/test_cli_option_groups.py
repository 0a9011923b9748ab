"""Options shared by several commands, written once (`keys add` and `set-policy` share the policy
flags, `audit list` and `export` the filters): typer offers each command the group's options in
its place, passes the command what the group made of them, and a group that cannot be spliced
in is refused when the command is defined, not when it runs."""

from __future__ import annotations

from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from orchestrator.governance.cli_option_groups import with_options


def sizes(
    low: Annotated[int, typer.Option(help="The least.")] = 1,
    high: Annotated[int | None, typer.Option(help="The most.")] = None,
) -> tuple[int, int | None]:
    return low, high


def test_a_command_gets_what_the_group_made_and_its_help_lists_the_options() -> None:
    app = typer.Typer()
    seen: list[object] = []

    @app.command()
    @with_options("bounds", sizes)
    def pick(
        name: str,
        *,
        bounds: tuple[int, int | None],
        loud: Annotated[bool, typer.Option("--loud")] = False,
    ) -> None:
        seen.append((name, bounds, loud))

    result = CliRunner().invoke(app, ["x", "--high", "9", "--loud"])
    assert result.exit_code == 0, result.output
    assert seen == [("x", (1, 9), True)]
    shown = CliRunner().invoke(app, ["--help"]).output
    assert shown.index("--low") < shown.index("--high") < shown.index("--loud")
    assert "The most." in shown
    wrong = CliRunner().invoke(app, ["x", "--low", "many"])
    assert wrong.exit_code == 2 and len(seen) == 1  # typed as the group says: not run


def test_a_group_that_cannot_be_spliced_in_is_refused_at_once() -> None:
    def positional(bounds: tuple[int, int | None]) -> None: ...

    def clashing(*, bounds: tuple[int, int | None], low: int = 0) -> None: ...

    with pytest.raises(TypeError, match="no keyword-only parameter 'bounds'"):
        with_options("bounds", sizes)(positional)
    with pytest.raises(TypeError, match=r"options of its own named \['low'\]"):
        with_options("bounds", sizes)(clashing)
