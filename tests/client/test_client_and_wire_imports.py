"""The client stands on the wire package alone: no client module imports `orchestrator`,
`sandbox` or `kernel_images` (so a client-only install carries none of them), the wire package
imports nothing else of this project, and the embedded session, which is the server's, is found
through the package's entry point rather than an import.

Each rule is checked twice: by reading every import statement (a lazy one inside a function
included), and by importing every module in a fresh interpreter and looking at what loaded.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from code_interpreter_client.code_session import EMBEDDED, SESSIONS_GROUP, CodeSession
from orchestrator.embedded_session import EmbeddedSession

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "code_interpreter_wire",
    "code_interpreter_client",
    "orchestrator",
    "sandbox",
    "kernel_images",
}
# What each package may import of ours (itself included).
MAY_IMPORT = {
    "code_interpreter_wire": {"code_interpreter_wire"},
    "code_interpreter_client": {"code_interpreter_client", "code_interpreter_wire"},
}


def modules_of(package: str) -> list[str]:
    """Every module of `package`, by dotted name, its subpackages' included."""
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_by(path: Path) -> set[str]:
    """The absolute module names `path` imports anywhere in it (in functions and
    `if TYPE_CHECKING:` blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def forbidden_imports(package: str, root: Path = ROOT) -> list[str]:
    allowed = MAY_IMPORT[package]
    return [
        f"{path.relative_to(root)} imports {name}"
        for path in sorted((root / package).rglob("*.py"))
        for name in sorted(imported_by(path))
        if name.split(".")[0] in OURS - allowed
    ]


def loaded_by_importing(modules: list[str]) -> list[str]:
    """What of ours a fresh interpreter holds after importing `modules`."""
    script = textwrap.dedent(
        f"""
        import importlib, json, sys
        for name in {modules!r}:
            importlib.import_module(name)
        ours = {sorted(OURS)!r}
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ours)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_no_module_names_a_package_below_it_may_not_import(package: str) -> None:
    assert len(modules_of(package)) > 5  # the walk found the package
    found = forbidden_imports(package)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_importing_every_module_loads_nothing_it_may_not_import(package: str) -> None:
    loaded = loaded_by_importing(modules_of(package))
    assert f"{package}.code_session" in loaded or package == "code_interpreter_wire"
    beyond = [name for name in loaded if name.split(".")[0] not in MAY_IMPORT[package]]
    assert not beyond, beyond


def test_the_checks_see_a_forbidden_import(tmp_path: Path) -> None:
    """Both checks can fail: a lazy import of the server is read, and a loaded one is seen."""
    client = tmp_path / "code_interpreter_client"
    client.mkdir()
    (client / "lazy.py").write_text(
        "def make():\n    from orchestrator.service import Service\n    return Service\n"
    )
    assert forbidden_imports("code_interpreter_client", tmp_path) == [
        "code_interpreter_client/lazy.py imports orchestrator.service"
    ]
    assert "sandbox.backends.registry" in loaded_by_importing(
        ["code_interpreter_wire", "sandbox.backends.registry"]
    )


def test_the_embedded_session_is_the_servers_found_by_its_entry_point() -> None:
    [entry] = importlib.metadata.entry_points(group=SESSIONS_GROUP, name=EMBEDDED)
    assert entry.value == "orchestrator.embedded_session:EmbeddedSession"
    session = CodeSession.embedded("local")  # made lazily: no sandbox until the first call
    try:
        assert isinstance(session, EmbeddedSession)
        assert session.session_id is None
    finally:
        session.close_sync()


def test_without_the_entry_point_an_embedded_session_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As an install that lacks the server's entry point (a copy of the client alone) finds.
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda **_: importlib.metadata.EntryPoints(())
    )
    with pytest.raises(
        ModuleNotFoundError, match=r"pip install 'code-interpreter-runtime\[server\]'"
    ):
        CodeSession.embedded("local")
