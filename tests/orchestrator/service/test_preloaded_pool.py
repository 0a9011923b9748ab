"""A warm pool with a preload (`preload_modules`, `preload_code`): its sandboxes have imported
the modules and run the warm-up before the hand-over, and the session's code cannot tell it from
a fresh kernel but by `sys.modules`: a clean namespace, empty `In`/`Out`, execution count 1.
Preload settings that name no module are refused when the service starts, saying which."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from orchestrator.config import Settings
from sandbox.preload import ANALYST_PRELOAD
from tests.orchestrator.service.conftest import Server, leftovers, make_server, service_backends

# Beside the analyst warm-up: a name the warm-up binds and a line it prints, neither of which
# the session may see.
WARM_UP = ANALYST_PRELOAD + "left_by_the_preload = 42\nprint('printed by the preload')\n"

LOOK = (
    "import sys\n"
    "(sorted(k for k in globals() if not k.startswith('_') and k not in "
    "('In', 'Out', 'get_ipython', 'exit', 'quit', 'open', 'sys')), "
    "len(In), len(Out), repr(_), "
    "all(m in sys.modules for m in ('pandas', 'matplotlib.pyplot', 'e2b_charts')))"
)


@pytest.fixture(scope="module")
def preloaded() -> Iterator[Server]:
    srv = make_server(
        pool_size=1,
        preload_modules="pandas, numpy,matplotlib.pyplot",
        preload_code=WARM_UP,
    )
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def wait_for_pool(server: Server, backend: str) -> None:
    with server.client() as api:
        deadline = time.monotonic() + 120
        while api.get("/v1/status").json()["pools"][backend] < 1:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.1)


@pytest.mark.parametrize("backend", service_backends())
def test_a_preloaded_sandbox_looks_fresh_to_its_code(preloaded: Server, backend: str) -> None:
    wait_for_pool(preloaded, backend)
    with preloaded.client() as api:
        session = api.post("/v1/sessions", json={"backend": backend}).json()
        assert session["from_pool"] is True
        sid = session["id"]
        try:
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": LOOK}).json()
            assert ran["error"] is None, ran
            assert ran["stdout"] == ""  # the preload's print went nowhere
            assert ran["execution_count"] == 1
            assert ran["results"][0]["text"] == "([], 2, 0, \"''\", True)"  # In: '' and this cell
            # The next cell is the second, as in any fresh kernel.
            again = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"}).json()
            assert again["execution_count"] == 2 and again["results"][0]["text"] == "2"
        finally:
            api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("names", ["pandas;import os", "1abc", "pandas,,os.", "a b"])
def test_names_that_are_not_modules_are_refused(names: str) -> None:
    with pytest.raises(ValueError, match="is not a module name"):
        Settings(preload_modules=names)  # type: ignore[arg-type]


def test_the_service_refuses_to_start_with_a_bad_module_name() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from orchestrator.config import Settings; Settings()"],
        env={"CODE_INTERPRETER_PRELOAD_MODULES": "pandas;import os", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "'pandas;import os' is not a module name" in done.stderr
