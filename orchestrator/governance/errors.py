"""Refusals of governance: a key's policy says no, or a human did."""

from __future__ import annotations

from orchestrator.sessions import SessionError

ASK_AN_ADMIN = "Ask an admin to change it (code-interpreter keys set-policy)"


class PolicyDenied(SessionError):
    """A request outside its key's policy; the message names the key, the rule and what the
    rule allows."""

    status = 403

    def __init__(self, message: str, *, key: str = "", rule: str = "") -> None:
        super().__init__(message)
        self.key = key  # the principal's name
        self.rule = rule  # the Policy field that refused

    @classmethod
    def by_rule(
        cls, key: str, what: str, rule: str, says: str, hint: str = ASK_AN_ADMIN
    ) -> PolicyDenied:
        """The refusal as people read it, e.g. key 'analyst' may not use the docker backend: its
        policy's rule `backends` allows: local. Ask an admin to change it (...)."""
        return cls(
            f"key {key!r} may not {what}: its policy's rule `{rule}` {says}. {hint}",
            key=key,
            rule=rule,
        )

    @classmethod
    def revoked(cls, key: str) -> PolicyDenied:
        """A revoked key's session, reached before the reaper ended it."""
        return cls(
            f"key {key!r} was revoked: its sessions are ending and may do nothing more. Ask an "
            "admin for a new key (code-interpreter keys add)",
            key=key,
            rule="revoked",
        )


class ApprovalDenied(SessionError):
    """An execution or a command that had to wait for a human was denied (or no one answered
    in time); the message says who decided and why."""

    status = 403
