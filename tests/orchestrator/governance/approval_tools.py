"""Host tools the approval tests register in a served service, by import path
(`tests.orchestrator.governance.approval_tools:TOOLS`): two that wait for a human, one that does
not."""

from __future__ import annotations

from orchestrator.host_tools import function_tool


def send_money(to: str, amount: int, memo: str = "") -> str:
    """Send money to someone: each call waits for a human's approval.

    Args:
        to: Who gets it.
        amount: How much.
        memo: A note sent with it.
    """
    return f"sent {amount} to {to}"


def notify_team(message: str) -> str:
    """Post a message to the team (the operator's webhook decides these).

    Args:
        message: What to post.
    """
    return f"posted: {message}"


def add(a: int, b: int) -> int:
    """Add two integers (no approval of its own; a key's policy may still ask for one)."""
    return a + b


TOOLS = [
    function_tool(send_money, requires_approval=True),
    function_tool(notify_team, requires_approval=True),
    add,
]
