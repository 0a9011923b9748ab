"""The web console for the humans in the loop (docs/governance.md): live sessions, each one's
executions and commands, the approval queue, and the audit log; server-rendered pages behind the
service's keys, with htmx and Pico CSS served from the package (no CDN)."""

from orchestrator.console.app import PREFIX, console_app

__all__ = ["PREFIX", "console_app"]
