"""The service is the only door into a session: front doors parse, call `Service`, and format.

A front door that reaches a session's sandbox, the session manager, or marks activity itself
would bypass what the service does once for everyone (activity, caps, metrics, and soon
permissions and audit). This reads the front doors' source and names any such reach.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRONT_DOORS = [
    *sorted((ROOT / "orchestrator" / "routes").glob("*.py")),
    *sorted((ROOT / "orchestrator" / "e2b_compatible").glob("*.py")),
    *sorted((ROOT / "orchestrator" / "mcp_front").glob("*.py")),
    *sorted((ROOT / "code_interpreter_client").glob("*.py")),
    ROOT / "orchestrator" / "app.py",
    ROOT / "orchestrator" / "cli.py",
]
# Attributes a front door may not reach on anything: a session's sandbox, the service's
# session manager, and the session's own activity clock.
FORBIDDEN_ATTRIBUTES = {"sandbox", "sessions", "activity", "touch", "outputs"}


def reaches(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    return found


def test_the_front_doors_exist() -> None:
    missing = [str(p) for p in FRONT_DOORS if not p.is_file()]
    assert not missing
    assert len(FRONT_DOORS) > 15  # the globs found the packages


def test_no_front_door_reaches_past_the_service() -> None:
    found = [line for path in FRONT_DOORS for line in reaches(path)]
    assert not found, "front doors must call Service instead:\n" + "\n".join(found)


def test_the_rule_sees_a_reach(tmp_path: Path) -> None:
    """The check itself can fail: a file that reaches a sandbox is named."""
    planted = tmp_path / "route.py"
    planted.write_text("async def f(session):\n    await session.sandbox.restart()\n")
    assert reaches(planted, tmp_path) == ["route.py:2: .sandbox"]
