"""A client-only install (`pip install code-interpreter-runtime`) pulls a small, listed set of
packages and works: the client package imports nothing of the server stack.

The import check runs in a fresh interpreter where every server-stack module refuses to load, as
it would on a machine where the `server` extra is not installed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "code-interpreter-runtime"
# What a client-only install asks for, and nothing else (README "Install" lists the same).
CLIENT_REQUIREMENTS = {"pydantic>=2.11", "httpx>=0.27"}
# The top-level modules of the `server` extra's packages (and of their web stack, and the
# console's templates); test_every_server_package_is_refused keeps it whole.
SERVER_MODULES = [
    "fastapi", "starlette", "uvicorn", "docker", "jupyter_client", "zmq", "mcp", "e2b",
    "e2b_code_interpreter", "typer", "rich", "prometheus_client", "pyseccomp", "jsonschema",
    "griffe", "multipart", "python_multipart", "pydantic_settings", "jinja2", "markupsafe",
    "websockets", "limits", "cryptography", "tenacity", "publicsuffixlist",
]  # fmt: skip

REFUSE_SERVER_MODULES = f"""
import importlib.abc
import sys

SERVER_MODULES = {SERVER_MODULES!r}


class RefuseServerModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in SERVER_MODULES:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed)", name=name)
        return None


def refuse_server_modules():
    sys.meta_path.insert(0, RefuseServerModules())
"""


def run_without_server(body: str) -> subprocess.CompletedProcess[str]:
    script = REFUSE_SERVER_MODULES + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_client_imports_and_constructs_without_the_server_stack() -> None:
    done = run_without_server(
        """
        refuse_server_modules()
        import asyncio

        import code_interpreter_client
        from code_interpreter_client import AsyncClient, Client, CodeSession

        with Client("http://127.0.0.1:9", "key"):
            pass
        asyncio.run(AsyncClient("http://127.0.0.1:9", "key").close())
        remote = CodeSession.remote("http://127.0.0.1:9", "key")
        assert remote.session_id is None
        import sandbox
        from code_interpreter_wire.results import Execution
        from code_interpreter_wire.spec import SandboxSpec
        from code_interpreter_wire.errors import SandboxError
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_MODULES)
        assert not loaded, loaded
        print("client ok")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "client ok" in done.stdout


@pytest.mark.parametrize(
    ("framework", "adapter"),
    [
        ("langchain_core.tools", "code_interpreter_client.langchain"),
        ("agents", "code_interpreter_client.openai_agents"),
    ],
)
def test_the_framework_adapters_import_without_the_server_stack(
    framework: str, adapter: str
) -> None:
    # The framework loads first, with whatever it needs (the Agents SDK brings mcp and
    # starlette itself); then the adapter and what it brings must stay clear of the server.
    done = run_without_server(
        f"""
        import importlib

        importlib.import_module({framework!r})
        before = set(sys.modules)
        refuse_server_modules()
        importlib.import_module({adapter!r})
        brought = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in SERVER_MODULES)
        assert not brought, brought
        print("adapter ok")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "adapter ok" in done.stdout


def test_an_embedded_session_without_the_server_says_which_extra_to_install() -> None:
    done = run_without_server(
        """
        refuse_server_modules()
        from code_interpreter_client import CodeSession

        try:
            CodeSession.embedded("local")
        except ModuleNotFoundError as exc:
            print("refused:", exc)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install 'code-interpreter-runtime[server]'" in done.stdout, done.stdout


def test_the_command_without_the_server_says_which_extra_to_install_in_one_line() -> None:
    done = run_without_server(
        """
        refuse_server_modules()
        sys.argv = ["code-interpreter", "--help"]
        from orchestrator.entry import main

        main()
        """
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "pip install 'code-interpreter-runtime[server]'" in line, line


def test_the_command_runs_through_its_entry_point() -> None:
    [script] = importlib.metadata.entry_points(group="console_scripts", name="code-interpreter")
    assert script.value == "orchestrator.entry:main"
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['code-interpreter', '--help']\n"
         "from orchestrator.entry import main; main()"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "serve" in done.stdout


def test_the_refusal_is_real() -> None:
    """The check can fail: a server module is refused under it."""
    done = run_without_server("refuse_server_modules()\nimport fastapi\n")
    assert done.returncode != 0 and "No module named 'fastapi'" in done.stderr


def test_a_client_only_install_asks_for_the_listed_packages_only() -> None:
    declared = importlib.metadata.requires(DISTRIBUTION) or []
    base = {
        str(requirement)
        for requirement in map(Requirement, declared)
        if requirement.marker is None  # extras carry an `extra == "..."` marker
    }
    assert base == CLIENT_REQUIREMENTS


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` pull in when installed without extras (normalised names)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = _normal(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in map(Requirement, declared):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_every_server_package_is_refused() -> None:
    """Each package the `server` extra adds (and a client install does not bring anyway, as
    httpx brings h11) has its modules in SERVER_MODULES: the checks above refuse it."""
    declared = map(Requirement, importlib.metadata.requires(DISTRIBUTION) or [])
    server = [
        r.name
        for r in declared
        if r.marker is not None
        and r.marker.evaluate({"extra": "server"})
        and not r.marker.evaluate({"extra": ""})
    ]
    assert "fastapi" in server and "jinja2" in server
    client = _closure([Requirement(r).name for r in CLIENT_REQUIREMENTS])
    modules: dict[str, set[str]] = {}
    for module, distributions in importlib.metadata.packages_distributions().items():
        for distribution in distributions:
            modules.setdefault(_normal(distribution), set()).add(module)
    unrefused = {
        name: sorted(modules.get(_normal(name), set()))
        for name in server
        if _normal(name) not in client
        and not modules.get(_normal(name), set()) & set(SERVER_MODULES)
    }
    assert not unrefused, f"add their modules to SERVER_MODULES: {unrefused}"
