"""The `code-interpreter` command's entry point: the CLI, or one line saying what to install.

A client-only install (`pip install code-interpreter-runtime`) has the command but not the
service's packages; without this, it would end in a traceback about some module deep inside.
"""

from __future__ import annotations

import sys

from code_interpreter_wire.server_extra import missing_server_module, server_extra_hint


def main() -> None:
    try:
        from orchestrator.cli import app

        # Its commands import some of the server's packages only when they run.
        app(prog_name="code-interpreter")
    except ModuleNotFoundError as exc:
        module = missing_server_module(exc)
        if module is None:
            raise
        print(f"code-interpreter: {server_extra_hint('the command', module)}", file=sys.stderr)
        raise SystemExit(1) from None
