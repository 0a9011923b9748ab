"""The base of the errors a session's callers get, each mapped to one HTTP status by every front
door. Apart from orchestrator/sessions.py so that the stores below it (state_store) raise
errors of the same kind without importing the session table."""

from __future__ import annotations


class SessionError(Exception):
    """Base of the session errors; each maps to one HTTP status."""

    status = 400
