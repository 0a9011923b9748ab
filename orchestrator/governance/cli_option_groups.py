"""Options several typer commands share, written once. Typer has nothing like FastAPI's
`Depends`: here a group of options is the parameters of one function, and a command takes what
that function makes as one keyword-only parameter; typer sees the group's options in its place
(in that order, with their help), so each command's `--help` reads as if it listed them."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

Result = TypeVar("Result")


def with_options(
    parameter: str, group: Callable[..., Any]
) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Decorate a command (below `@app.command`) whose keyword-only `parameter` takes
    `group(**its options)`; the group's option names must not be the command's own."""

    def decorate(command: Callable[..., Result]) -> Callable[..., Result]:
        own = inspect.signature(command, eval_str=True)
        options = inspect.signature(group, eval_str=True).parameters
        taken = own.parameters.get(parameter)
        if taken is None or taken.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"{command.__name__} has no keyword-only parameter {parameter!r}")
        if clash := set(options) & set(own.parameters):
            raise TypeError(f"{command.__name__} has options of its own named {sorted(clash)}")
        spliced: list[inspect.Parameter] = []
        for name, param in own.parameters.items():
            if name != parameter:
                spliced.append(param)
                continue
            spliced += [o.replace(kind=inspect.Parameter.KEYWORD_ONLY) for o in options.values()]

        @functools.wraps(command)
        def run(**given: Any) -> Result:
            made = group(**{name: given.pop(name) for name in options})
            return command(**given, **{parameter: made})

        signature = own.replace(parameters=spliced)
        run.__signature__ = signature  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in spliced} | {
            "return": own.return_annotation
        }
        return run

    return decorate
