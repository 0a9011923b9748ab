"""What an answer to an approval request (or a request itself) can be refused with; a refusal
says why and what to do. A denied execution or command is `errors.ApprovalDenied`."""

from __future__ import annotations

from orchestrator.sessions import SessionError


class ApprovalNotFound(SessionError):
    """No such request, or one of another key's sessions (told alike, as sessions are)."""

    status = 404


class ApprovalForbidden(SessionError):
    """The key may see the request but not answer it; the message names the rule."""

    status = 403


class ApprovalAlreadyDecided(SessionError):
    """The request was answered already (by whom, how, is said): one answer wins."""

    status = 409


class ApprovalsFull(SessionError):
    """Too many requests wait already (in the session, or on this replica): refused, not
    queued, so that waiting requests never grow without bound."""

    status = 429
