"""Shows an execution in a terminal: its output, results, images and errors, and copied files."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from code_interpreter_wire.results import (
    ErrorEvent,
    Execution,
    ExecutionStatus,
    OutputEvent,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)

# Exit codes of `code-interpreter run`, one per way an execution can end.
EXIT_CODES = {
    ExecutionStatus.OK: 0,
    ExecutionStatus.ERROR: 1,
    ExecutionStatus.TIMEOUT: 124,  # as timeout(1)
    ExecutionStatus.KERNEL_DIED: 125,
    ExecutionStatus.CANCELLED: 130,
}


class TerminalPrinter:
    """Prints stdout to stdout and everything else to stderr, so pipes get only the output.

    Nothing is wrapped: rich would fold lines at the terminal's width (80 columns in a pipe),
    breaking a traceback's lines in two; a terminal folds long lines by itself.
    """

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self._shown_traceback = ""

    async def on_event(self, event: OutputEvent) -> None:
        """Print each output as the code makes it."""
        if isinstance(event, StdoutEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, StderrEvent):
            self.err.print(escape(event.text), end="", style="yellow")
        elif isinstance(event, ResultEvent):
            if event.result.text is not None and not event.result.images():
                prefix = "[bold green]Out:[/] " if event.result.is_main_result else ""
                self.err.print(prefix + escape(event.result.text))
        elif isinstance(event, ErrorEvent):
            error = event.error
            if error.traceback and error.traceback != self._shown_traceback:
                self.err.print(escape(error.traceback), style="red")
                self._shown_traceback = error.traceback
            if not error.traceback.rstrip().endswith(f"{error.name}: {error.value}".rstrip()):
                self.err.print(f"[bold red]{escape(error.name)}:[/] {escape(error.value)}")

    def finish(self, execution: Execution) -> int:
        """After the events: the notice, the images saved, what the caps dropped; the exit code
        that says how it ended."""
        if execution.notice:
            self.err.print(f"[bold yellow]Note:[/] {escape(execution.notice)}")
        for artifact in execution.artifacts:
            self.save(f"figure-{artifact.id[:12]}.{artifact.extension}", artifact.data, "image")
        for name, dropped in (
            ("stdout", execution.stdout_dropped),
            ("stderr", execution.stderr_dropped),
        ):
            if dropped:
                self.err.print(f"[yellow]{dropped} characters of {name} were dropped by the cap[/]")
        return EXIT_CODES[execution.status]

    def save(self, name: str, data: bytes, kind: str = "file") -> Path:
        """Write a file the run produced into the output directory, and say where."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / name
        path.write_bytes(data)
        self.err.print(f"[cyan]{kind} saved:[/] {escape(str(path))}")
        return path

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]error:[/] {escape(message)}")
