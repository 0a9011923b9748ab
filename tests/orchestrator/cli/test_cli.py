"""The `code-interpreter` command, run as a user runs it."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from orchestrator.config import Settings
from tests.conftest import SELECTED, require_backend

CLI = [sys.executable, "-m", "orchestrator"]
REPO = Path(__file__).resolve().parents[3]


def run_cli(
    *args: str,
    cwd: Path | None = None,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        input=stdin,
        env=env if env is not None else {**os.environ, "COLUMNS": "200"},
    )


def test_run_prints_output_and_saves_images(tmp_path: Path) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "print('hello from the sandbox')\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
        "6 * 7"
    )
    done = run_cli("run", code, "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from the sandbox\n"
    assert "Out: 42" in done.stderr
    images = list((tmp_path / "out").glob("figure-*.png"))
    assert len(images) == 1
    assert Image.open(io.BytesIO(images[0].read_bytes())).format == "PNG"


def test_run_a_file(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(sys.version_info[0])\n")
    done = run_cli("run", "-f", str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "3\n"
    long_form = run_cli("run", "--script", str(script))
    assert long_form.returncode == 0, long_form.stderr
    assert long_form.stdout == "3\n"


def test_run_a_script_from_stdin() -> None:
    done = run_cli("run", "-f", "-", stdin="total = sum(range(7))\nprint('total', total)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "total 21\n"


@pytest.mark.parametrize("backend_name", SELECTED)
def test_files_go_in_before_the_run_and_come_back_after(backend_name: str, tmp_path: Path) -> None:
    require_backend(backend_name)
    data = tmp_path / "data.csv"
    data.write_text("month,revenue\n1,10\n2,12\n")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"\x00binary\xffnotes")
    script = tmp_path / "report.py"
    script.write_text(
        textwrap.dedent("""\
            import csv, json, os
            rows = list(csv.DictReader(open('data.csv')))
            total = sum(int(r['revenue']) for r in rows)
            summary = {'total': total, 'notes': os.path.getsize('notes.txt')}
            json.dump(summary, open('summary.json', 'w'))
            os.makedirs('tables', exist_ok=True)
            lines = ['month,revenue'] + [r['month'] + ',' + r['revenue'] for r in rows]
            open('tables/by_month.csv', 'w').write('\\n'.join(lines))
            print('total', total)
        """)
    )
    out = tmp_path / "out"
    done = run_cli(
        "run", "--backend", backend_name, "-f", str(script),
        "--file", str(data), "--file", str(notes),
        "--download", "summary.json", "--download", "tables/by_month.csv",
        "--output-dir", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "total 22\n"
    assert json.loads((out / "summary.json").read_text()) == {
        "total": 22,
        "notes": len(notes.read_bytes()),
    }
    assert (out / "by_month.csv").read_text() == "month,revenue\n1,10\n2,12"
    assert "saved:" in done.stderr and "by_month.csv" in done.stderr


def test_a_file_the_run_did_not_make_is_named(tmp_path: Path) -> None:
    done = run_cli(
        "run", "open('made.txt', 'w').write('yes')",
        "--download", "made.txt", "--download", "never_made.txt", "-o", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "never_made.txt" in done.stderr
    assert (tmp_path / "made.txt").read_text() == "yes"
    assert not (tmp_path / "never_made.txt").exists()


def test_tracebacks_and_output_are_not_wrapped_in_a_pipe() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    long_value = "x" * 150
    done = run_cli(
        "run",
        f"import sys\nprint('{'e' * 120}', file=sys.stderr)\n'{'r' * 120}'\n"
        f"def a_function_with_a_rather_long_name_to_make_the_line_long(v):\n"
        f"    raise ValueError(v)\n"
        f"a_function_with_a_rather_long_name_to_make_the_line_long('{long_value}')",
        env=env,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert f"ValueError: {long_value}" in lines, done.stderr
    assert "e" * 120 in lines, done.stderr
    assert any(line.endswith("'" + "r" * 120 + "'") for line in lines), done.stderr


def test_exit_codes_say_how_it_ended(tmp_path: Path) -> None:
    raised = run_cli("run", "raise ValueError('bad input')")
    assert raised.returncode == 1
    assert "ValueError" in raised.stderr and "bad input" in raised.stderr
    timed_out = run_cli("run", "import time; time.sleep(30)", "--timeout", "1")
    assert timed_out.returncode == 124
    assert "ExecutionTimeout" in timed_out.stderr
    died = run_cli("run", "import os; os._exit(1)")
    assert died.returncode == 125


def test_bad_usage_is_explained(tmp_path: Path) -> None:
    neither = run_cli("run")
    assert neither.returncode == 2
    assert "either CODE or --script" in neither.stderr
    unknown = run_cli("run", "1", "--backend", "nope")
    assert unknown.returncode == 2
    assert "unknown backend 'nope'" in unknown.stderr
    missing = run_cli("run", "-f", str(tmp_path / "nowhere.py"))
    assert missing.returncode == 2
    assert "nowhere.py" in missing.stderr
    clash = run_cli("run", "1", "--file", __file__, "--file", str(Path(__file__)))
    assert clash.returncode == 2
    assert "test_cli.py" in clash.stderr
    tiny = run_cli("run", "1", "--memory-mb", "10")  # was a pydantic traceback
    assert tiny.returncode == 2
    assert "--memory-mb" in tiny.stderr and "greater than or equal to 64" in tiny.stderr
    assert "Traceback" not in tiny.stderr


def test_version_is_the_installed_package_version() -> None:
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout
        == f"code-interpreter {importlib.metadata.version('code-interpreter-runtime')}\n"
    )


HELP_PAGES = [
    (), ("run",), ("exec",), ("serve",), ("mcp",),
    ("image",), ("image", "build"), ("image", "list"),
]  # fmt: skip


@pytest.mark.parametrize("command", HELP_PAGES, ids=lambda c: " ".join(c) or "top")
def test_help_shows_no_type_placeholders(command: tuple[str, ...]) -> None:
    done = run_cli(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert not re.search(r"<[\w|-]+>", done.stdout), done.stdout


def test_help_names_every_backend_and_how_serve_is_configured() -> None:
    flat = {c: " ".join(run_cli(c, "--help").stdout.split()) for c in ("run", "serve")}
    assert "local, docker, gvisor, e2b, ray, microvm or wasm" in flat["run"]
    assert "microvm or wasm (ray: cluster mode)" in flat["serve"]
    serve = flat["serve"]
    for setting in ("host", "port"):
        assert f"[default: {Settings.model_fields[setting].default}]" in serve, serve
    assert "CODE_INTERPRETER_API_KEYS" in serve
    assert "CODE_INTERPRETER_AUTH_DISABLED=true" in serve
    assert "one user" in serve
    assert "CODE_INTERPRETER_CONFIG" in serve


def _without_settings() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODE_INTERPRETER_")}
    return {**env, "COLUMNS": "200"}


def test_a_bad_setting_is_named_one_line_each() -> None:
    env = {
        **_without_settings(),
        "CODE_INTERPRETER_PORT": "eighty",
        "CODE_INTERPRETER_POOL_SIZE": "-1",
    }
    done = run_cli("serve", env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr  # the port and the pool size, one line each
    assert any("CODE_INTERPRETER_PORT" in line for line in lines), done.stderr
    assert any("CODE_INTERPRETER_POOL_SIZE" in line for line in lines), done.stderr
    assert "pydantic" not in done.stderr


@pytest.fixture
def python_without_ipykernel() -> Iterator[str]:
    """A venv of the system Python with no packages at all, where sandbox uids can reach it."""
    root = Path(tempfile.mkdtemp(prefix="cir-test-venv-", dir="/tmp"))
    root.chmod(0o755)
    try:
        subprocess.run(
            ["/usr/bin/python3", "-m", "venv", "--without-pip", str(root / "venv")], check=True
        )
        yield str(root / "venv" / "bin" / "python")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_python_without_the_kernel_extra_says_which_extra_to_install(
    python_without_ipykernel: str,
) -> None:
    # The command runs under an interpreter that has the project but not ipykernel, as after
    # `pip install code-interpreter-runtime[server]`: the local backend's kernel is that one.
    site_packages = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{REPO}:{site_packages}"}
    done = run_cli("run", "1 + 1", env=env, python=python_without_ipykernel)
    assert done.returncode == 2, done.stderr
    assert "pip install 'code-interpreter-runtime[kernel]'" in done.stderr, done.stderr
    assert python_without_ipykernel in done.stderr


def test_a_download_cannot_reach_out_of_the_workspace_or_the_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(
        "run", "import os; os.symlink('/etc/hostname', 'link')",
        "--download", "../../etc/hostname", "--download", "link", "-o", str(out),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "../../etc/hostname" in done.stderr and "'link'" in done.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_run_prints_output_as_the_code_makes_it(tmp_path: Path) -> None:
    """A long script shows its first line while it still runs, not only when it ends."""
    code = "print('first', flush=True)\nimport time\ntime.sleep(120)\nprint('never')"
    proc = subprocess.Popen(
        [*CLI, "run", code, "--output-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "first\n"  # arrives while the code sleeps
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=60)


# --- exec: a command in a sandbox


def test_exec_runs_argv_and_exits_with_its_exit_code() -> None:
    program = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = run_cli("exec", "--", "python3", "-c", program)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "out\n"
    assert "err\n" in done.stderr
    ok = run_cli("exec", "--", "sh", "-c", "echo $((6 * 7))")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "42\n"
    # argv as it is: no shell reads it unless the user asks for one.
    literal = run_cli("exec", "--", "echo", "$HOME", "a;b", "*")
    assert literal.stdout == "$HOME a;b *\n", literal.stderr
    # Without --, the command's own options are its own.
    bare = run_cli("exec", "ls", "-a", "/workspace")
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.split()[:2] == [".", ".."]


def test_exec_past_its_time_limit_exits_124() -> None:
    done = run_cli("exec", "--timeout", "1", "--", "sh", "-c", "echo started; sleep 60")
    assert done.returncode == 124, done.stderr
    assert done.stdout == "started\n"
    assert "time limit of 1 s" in done.stderr


@pytest.mark.parametrize("backend_name", SELECTED)
def test_exec_moves_files_in_and_out_and_finds_the_kernels_python(
    backend_name: str, tmp_path: Path
) -> None:
    require_backend(backend_name)
    data = tmp_path / "data.csv"
    data.write_text("month,revenue\n1,10\n2,12\n")
    out = tmp_path / "out"
    done = run_cli(
        "exec", "--backend", backend_name, "--file", str(data),
        "--download", "counted.txt", "--output-dir", str(out), "--",
        "bash", "-l", "-c",
        "wc -l < data.csv > counted.txt && python3 -c 'import pandas; print(pandas.__name__)'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "pandas\n"
    assert (out / "counted.txt").read_text() == "3\n"


def test_exec_prints_output_as_the_command_makes_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CLI, "exec", "--", "sh", "-c", "echo first; sleep 120; echo never"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "first\n"  # arrives while the command sleeps
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_exec_bad_usage_is_explained() -> None:
    nothing = run_cli("exec")
    assert nothing.returncode == 2
    assert "CMD" in nothing.stderr
    no_url = run_cli("exec", "--session-id", "s-123", "--", "ls")
    assert no_url.returncode == 2
    assert "--session-id needs --url" in no_url.stderr
    both = run_cli("exec", "--url", "http://127.0.0.1:9", "--backend", "docker", "--", "ls")
    assert both.returncode == 2
    assert "--backend" in both.stderr


def test_exec_in_a_session_of_a_running_service(tmp_path: Path) -> None:
    from tests.orchestrator.service.conftest import KEY_A, make_server

    server = make_server().start()
    try:
        with server.client(KEY_A) as api:
            sid = api.post("/v1/sessions", json={}).json()["id"]
            api.post(
                f"/v1/sessions/{sid}/execute",
                json={"code": "open('made.txt', 'w').write('made by code')"},
            )
            env = {**os.environ, "MY_SERVICE_KEY": KEY_A}
            url = ["--url", server.url, "--api-key-env", "MY_SERVICE_KEY"]
            done = run_cli("exec", *url, "--session-id", sid, "--", "cat", "made.txt", env=env)
            assert done.returncode == 0, done.stderr
            assert done.stdout == "made by code"
            failed = run_cli("exec", *url, "--session-id", sid, "--", "sh", "-c", "exit 5", env=env)
            assert failed.returncode == 5, failed.stderr
            # Without --session-id: a session of its own, ended after the command.
            fresh = run_cli("exec", *url, "--", "sh", "-c", "ls made.txt || echo absent", env=env)
            assert fresh.stdout.endswith("absent\n"), fresh.stderr
            assert [s["id"] for s in api.get("/v1/sessions").json()] == [sid]
            wrong = run_cli(
                "exec", *url, "--session-id", sid, "--", "true",
                env={**env, "MY_SERVICE_KEY": "wrong"},
            )  # fmt: skip
            assert wrong.returncode == 2
            assert "401" in wrong.stderr and "Traceback" not in wrong.stderr
            api.delete(f"/v1/sessions/{sid}")
    finally:
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)
