"""How the `code_interpreter` tool's description presents host tools: one line each, the call as
the sandbox sees it (required parameters first, optional ones keyword-only), and a summary."""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.host_tools.base import HostTool


def call_signature(tool: HostTool) -> str:
    """`get_expenses(member_id, *, since=None)`: the function as the sandbox defines it."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    names = [n for n in props if n in required and n.isidentifier()]
    optional = [n for n in props if n not in required and n.isidentifier()]
    if optional:
        names += ["*", *(f"{n}={_default(props[n])}" for n in optional)]
    return f"{tool.name}({', '.join(names)})"


def _default(schema: object) -> str:
    value = schema.get("default") if isinstance(schema, dict) else None
    text = repr(value)
    return text if len(text) <= 20 else "..."


def summaries(tools: Iterable[HostTool]) -> list[tuple[str, str]]:
    """(call signature, one-line summary) of each tool, for the model's tool description."""
    return [(call_signature(t), t.summary) for t in tools]
