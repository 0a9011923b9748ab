"""The service is the only door into a session: front doors parse, call `Service`, and format.

A front door that reaches a session's sandbox, the session manager, or marks activity itself
would bypass what the service does once for everyone (activity, caps, metrics, and soon
permissions and audit). Nor does a front reach past the facade's parts into what they hold (the
settings, the store, approvals, principals, the audit log): it calls a part (`lifecycle`, `runs`,
`files`, `admission`, `views`, `trail`, `channels`, `persistence`), and is handed at build time
the HTTP-level settings it needs. This reads the front doors' source and names any such reach.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FRONT_DOORS = [
    *sorted((ROOT / "orchestrator" / "routes").glob("*.py")),
    *sorted((ROOT / "orchestrator" / "e2b_compatible").glob("*.py")),
    *sorted((ROOT / "orchestrator" / "mcp_front").glob("*.py")),
    *sorted((ROOT / "orchestrator" / "console").glob("*.py")),
    *sorted((ROOT / "code_interpreter_client").rglob("*.py")),
    ROOT / "orchestrator" / "app.py",
    ROOT / "orchestrator" / "cli.py",
    ROOT / "orchestrator" / "embedded_session.py",
    ROOT / "orchestrator" / "model_tool.py",
]
# Attributes a front door may not reach on anything: a session's sandbox, the service's
# session manager, kept outputs and host-tool registry, and the session's own activity clock.
FORBIDDEN_ATTRIBUTES = {"sandbox", "sessions", "activity", "touch", "outputs", "tools"}
# What only the service's parts hold and read: a front reaches none of these on the service.
FORBIDDEN_ON_THE_SERVICE = {"settings", "store", "approvals", "principals", "audit"}
# What only the service itself holds and uses.
FORBIDDEN_IMPORTS = {
    "SessionManager",
    "OutputStore",
    "SharedOutputStore",
    "KeptOutputs",
    "ToolRegistry",
    "ToolChannel",
}
# Front doors that build the service itself (the app and the stdio MCP server make one; an
# embedded session makes its own) may import what configures it, never these.
MAY_BUILD_THE_SERVICE = {"app.py", "server.py", "embedded_session.py"}
BUILDERS_MAY_NOT_IMPORT = {"SessionManager", "OutputStore", "SharedOutputStore", "KeptOutputs"}


def _is_the_service(node: ast.expr) -> bool:
    """`service`, `self._service`, `console_of(request).service`: an expression naming it."""
    if isinstance(node, ast.Name):
        return node.id.lower().endswith("service")
    return isinstance(node, ast.Attribute) and node.attr.lower().endswith("service")


def reaches(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in FORBIDDEN_ON_THE_SERVICE
            and _is_the_service(node.value)
        ):
            found.append(f"{where}:{node.lineno}: service.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and (
                node.args[1].value in FORBIDDEN_ATTRIBUTES
                or (
                    node.args[1].value in FORBIDDEN_ON_THE_SERVICE and _is_the_service(node.args[0])
                )
            )
        ):
            found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id
            in (
                "vars",
                "dir",
            )
        ):
            found.append(f"{where}:{node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.ImportFrom) and path.name not in MAY_BUILD_THE_SERVICE:
            names = {alias.name for alias in node.names} & FORBIDDEN_IMPORTS
            found += [f"{where}:{node.lineno}: imports {name}" for name in sorted(names)]
        elif isinstance(node, ast.ImportFrom) and path.name in MAY_BUILD_THE_SERVICE:
            names = {alias.name for alias in node.names} & BUILDERS_MAY_NOT_IMPORT
            found += [f"{where}:{node.lineno}: imports {name}" for name in sorted(names)]
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_the_front_doors_exist() -> None:
    missing = [str(p) for p in FRONT_DOORS if not p.is_file()]
    assert not missing
    assert len(FRONT_DOORS) > 15  # the globs found the packages


def test_no_front_door_reaches_past_the_service() -> None:
    found = [line for path in FRONT_DOORS for line in reaches(path)]
    assert not found, "front doors must call Service instead:\n" + "\n".join(found)


def test_the_rule_sees_a_reach(tmp_path: Path) -> None:
    """The check itself can fail: each way of reaching past the service is named."""
    planted = tmp_path / "route.py"
    planted.write_text(
        "from orchestrator.sessions import SessionManager\n"
        "async def f(session, service):\n"
        "    await session.sandbox.restart()\n"
        "    box = getattr(session, 'sandbox')\n"
        "    vars(session)\n"
        "    service.tools.select([])\n"
        "    limit = service.settings.max_upload_bytes\n"
        "    await self._service.approvals.answer('ap-1', True, None, who)\n"
        "    console_of(request).service.audit.query(who, q)\n"
        "    getattr(service, 'principals')\n"
        "    service.admission.who(owner), service.trail.query(who, q)\n"
        "    settings.max_upload_bytes, store.get(1)\n"
    )
    assert reaches(planted, tmp_path) == [
        "route.py:1: imports SessionManager",
        "route.py:3: .sandbox",
        "route.py:4: getattr(..., 'sandbox')",
        "route.py:5: vars()",
        "route.py:6: .tools",
        "route.py:7: service.settings",
        "route.py:8: service.approvals",
        "route.py:9: service.audit",
        "route.py:10: getattr(..., 'principals')",
    ]
