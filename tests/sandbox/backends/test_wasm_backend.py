"""The wasm backend (sandbox/backends/wasm/): Python in Pyodide under Deno, stateful, with rich
results, errors, time limits and files; and a wall that lets nothing out: no host file, no
environment, no process, no network (a web server on loopback stands in for everything), even
through `js`, Pyodide's door to Deno's own API. Real Deno, real Pyodide (the pinned release
`make install` fetches)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import shutil
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from code_interpreter_wire.errors import (
    FileMissing,
    FileTooLarge,
    InvalidPath,
    LanguageUnavailable,
)
from code_interpreter_wire.results import Execution, ExecutionStatus, StdoutEvent
from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.wasm import distribution as distribution_module
from sandbox.backends.wasm.backend import WasmBackend, WasmBackendConfig
from sandbox.backends.wasm.sandbox import MAX_FILE, WasmSandbox
from tests.conftest import host_processes_with, require_backend, small_spec
from tests.network.upstream import Upstream, upstream

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wasm-state")


@pytest.fixture(scope="module")
async def backend(state_dir: Path) -> WasmBackend:
    require_backend("wasm")
    return WasmBackend(WasmBackendConfig(state_dir=state_dir))


@pytest.fixture(scope="module")
async def sandbox(backend: WasmBackend) -> AsyncIterator[WasmSandbox]:
    made = await backend.create(small_spec())
    yield made
    await made.close()


@pytest.fixture(scope="module")
def web() -> Iterator[Upstream]:
    with upstream() as up:
        yield up


async def test_state_lives_across_executions_with_output_and_rich_results(
    sandbox: WasmSandbox,
) -> None:
    assert (await sandbox.execute("total = 40")).status is ExecutionStatus.OK
    seen: list[object] = []

    async def sink(event: object) -> None:
        seen.append(event)

    ran = await sandbox.execute("print('adding'); total + 2", on_event=sink)
    assert (ran.status, ran.stdout, ran.results[0].text) == (ExecutionStatus.OK, "adding\n", "42")
    assert ran.results[0].is_main_result and ran.execution_count == 2
    assert StdoutEvent(text="adding\n") in seen
    shown = await sandbox.execute(
        "class Table:\n"
        "    def _repr_html_(self): return '<table><tr><td>1</td></tr></table>'\n"
        "    def _repr_json_(self): return {'rows': 1}\n"
        "Table()"
    )
    (result,) = shown.results
    assert result.html == "<table><tr><td>1</td></tr></table>"
    assert result.json_data == {"rows": 1}


async def test_an_error_has_the_codes_own_traceback(sandbox: WasmSandbox) -> None:
    ran = await sandbox.execute("def f():\n    return 1 / 0\nf()")
    assert ran.status is ExecutionStatus.ERROR
    assert ran.error is not None and ran.error.name == "ZeroDivisionError"
    assert 'File "<cell-' in ran.error.traceback and "return 1 / 0" not in ran.error.value
    assert "_pyodide" not in ran.error.traceback  # the interpreter's machinery left out
    assert (await sandbox.execute("'still here'")).results[0].text == "'still here'"


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import asyncio\nawait asyncio.sleep(60)",
        "import time\ntime.sleep(60)",
    ],
    ids=["running", "awaiting", "sleeping"],
)
async def test_a_time_limit_interrupts_python_and_the_state_stays(
    sandbox: WasmSandbox, code: str
) -> None:
    """Code that runs sees the interrupt flag; code that waits (an await, a sleep: Python is
    not running, so no flag reaches it) is ended where it waits."""
    await sandbox.execute("kept = 'yes'")
    ran = await sandbox.execute(code, timeout_s=1)
    assert ran.status is ExecutionStatus.TIMEOUT and not ran.state_lost, ran
    assert ran.error is not None and "time limit of 1 s" in ran.error.value
    assert (await sandbox.execute("kept")).results[0].text == "'yes'"
    slept = await sandbox.execute(
        "import time\nt = time.monotonic(); time.sleep(0.2)\ntime.monotonic() - t >= 0.2"
    )
    assert slept.results[0].text == "True"  # a sleep not interrupted sleeps its time


async def test_code_that_never_yields_costs_the_interpreter_and_says_so(
    backend: WasmBackend,
) -> None:
    async with await backend.create(small_spec()) as sandbox:
        await sandbox.execute("kept = 1")
        ran = await sandbox.execute("import js\njs.eval('while (true) {}')", timeout_s=1)
        assert ran.status is ExecutionStatus.TIMEOUT and ran.state_lost
        assert ran.notice is not None and "fresh interpreter" in ran.notice
        after = await sandbox.execute("kept")
        assert after.error is not None and after.error.name == "NameError"
        assert (await sandbox.execute("1 + 1")).results[0].text == "2"


async def test_memory_past_the_limit_is_a_memory_error_and_the_session_carries_on(
    sandbox: WasmSandbox,
) -> None:
    limit_mb = sandbox.spec.limits.memory_mb
    ran = await sandbox.execute(f"hog = bytearray({limit_mb} << 20)")
    assert ran.error is not None and ran.error.name == "MemoryError", ran
    ran = await sandbox.execute("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert ran.error is not None and ran.error.name == "MemoryError", ran
    freed = await sandbox.execute("n = len(chunks); del chunks; n")
    assert freed.status is ExecutionStatus.OK
    assert 0 < int(freed.results[0].text or 0) * 16 < limit_mb


async def spinning(sandbox: WasmSandbox) -> asyncio.Future[Execution]:
    """An execution that never ends by itself, once its code is seen running."""
    started = asyncio.Event()

    async def sink(event: object) -> None:
        started.set()

    running = asyncio.ensure_future(
        sandbox.execute("print('go', flush=True)\nwhile True:\n    pass", on_event=sink)
    )
    await started.wait()
    return running


async def test_an_interrupt_cancels_the_running_code_and_a_restart_starts_afresh(
    backend: WasmBackend,
) -> None:
    async with await backend.create(small_spec()) as sandbox:
        await sandbox.execute("kept = 1")
        running = await spinning(sandbox)
        assert sandbox.is_busy and await sandbox.interrupt()
        ran = await running
        assert ran.status is ExecutionStatus.CANCELLED and not ran.state_lost, ran
        assert not await sandbox.interrupt()  # nothing runs
        assert (await sandbox.execute("kept")).results[0].text == "1"
        await sandbox.restart()
        after = await sandbox.execute("kept")
        assert after.error is not None and after.error.name == "NameError"


async def test_memory_made_through_js_is_held_by_the_process_limit(backend: WasmBackend) -> None:
    """Buffers made outside the interpreter (through `js`) do not grow it: the process as a
    whole is held (RLIMIT_DATA), and the session answers after, afresh if Deno had to end."""
    async with await backend.create(small_spec()) as sandbox:
        ran = await sandbox.execute(
            "import js\nkept = [js.ArrayBuffer.new(256 << 20) for _ in range(64)]", timeout_s=60
        )
        assert ran.error is not None or ran.status is ExecutionStatus.KERNEL_DIED, ran
        assert (await sandbox.execute("1 + 1")).results[0].text == "2"


async def test_deno_writes_nothing_to_disk_for_the_sandbox(
    sandbox: WasmSandbox, state_dir: Path
) -> None:
    """Deno's own caches (compiled modules, the Cache API) are outside its permissions: they
    are kept nowhere, so importing modules in a loop fills no disk."""
    ran = await sandbox.execute(
        "import js\n"
        "for i in range(40):\n"
        "    src = f'export const v = {i}; // ' + 'x' * 100_000\n"
        "    await js.eval(f'import(\"data:text/javascript,{src}\")')\n"
        "try:\n"
        "    cache = await js.caches.open('c')\n"
        "    await cache.put('http://x/', js.Response.new('y' * 1_000_000))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)"
    )
    assert ran.status in (ExecutionStatus.OK, ExecutionStatus.ERROR), ran
    root = state_dir / "wasm" / sandbox.id
    written = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert written < 1 << 20, sorted(str(p) for p in root.rglob("*"))


async def test_a_caller_that_leaves_stops_its_code_and_the_state_stays(
    backend: WasmBackend,
) -> None:
    async with await backend.create(small_spec()) as sandbox:
        await sandbox.execute("kept = 'here'")
        left = await spinning(sandbox)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        after = await sandbox.execute("kept")  # waits for the stopping, then runs
        assert after.results[0].text == "'here'", after


async def test_one_write_larger_than_a_message_is_cut_not_fatal(sandbox: WasmSandbox) -> None:
    ran = await sandbox.execute("print('y' * 9_000_000)\n'after'")
    assert ran.status is ExecutionStatus.OK and not ran.state_lost, ran
    assert ran.results[0].text == "'after'" and ran.stdout_dropped > 0


async def test_output_is_capped(sandbox: WasmSandbox) -> None:
    limit = sandbox.spec.output_limit_chars
    ran = await sandbox.execute(f"print('x' * {limit * 4})")
    assert len(ran.stdout) <= limit + 200 and ran.stdout_dropped > 0


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        ("import js\njs.Deno.readTextFileSync('/etc/hostname')", "read access"),
        ("import js\njs.Deno.env.get('HOME')", "env access"),
        ("import js\njs.Deno.env.toObject()", "env access"),
        ("import js\njs.Deno.writeTextFileSync('/tmp/cir-wasm-was-here', 'x')", "write access"),
        ("import js\njs.Deno.Command.new('/usr/bin/id').outputSync()", "run access"),
        ("import js\nawait js.Deno.Command.new('/usr/bin/id').output()", "run access"),
        ("import js\njs.Deno.kill(1, 'SIGTERM')", "run access"),
        ("import js\njs.Deno.hostname()", "sys access"),
        ("import js\njs.Deno.dlopen('/lib/x86_64-linux-gnu/libc.so.6', js.Object.new())", "ffi"),
    ],
)
async def test_deno_refuses_what_the_sandbox_asks_of_the_host(
    sandbox: WasmSandbox, code: str, refused: str
) -> None:
    ran = await sandbox.execute(code)
    assert ran.status is ExecutionStatus.ERROR, ran
    assert ran.error is not None
    assert "NotCapable" in ran.error.traceback and refused in ran.error.traceback, ran.error


async def test_no_host_file_is_reachable_from_python(sandbox: WasmSandbox) -> None:
    ran = await sandbox.execute(
        "import os, json\n"
        "paths = ('/etc/passwd', '/root', '/usr/bin/python3', '/proc/1/environ')\n"
        "print(json.dumps([os.path.exists(p) for p in paths]))"
    )
    assert json.loads(ran.stdout) == [False] * 4  # its files are its own, in memory


async def test_no_network_even_to_loopback(sandbox: WasmSandbox, web: Upstream) -> None:
    url = f"http://127.0.0.1:{web.port}/hello"
    seen_before = len(web.requests)
    for code in (
        f"import js\nawait js.fetch({url!r})",
        f"import js\nawait js.Deno.connect(js.Object.fromEntries([['port', {web.port}]]))",
        f"import urllib.request\nurllib.request.urlopen({url!r}, timeout=5)",
        f"import socket\nsocket.create_connection(('127.0.0.1', {web.port}), timeout=5)",
    ):
        ran = await sandbox.execute(code, timeout_s=30)
        assert ran.status is ExecutionStatus.ERROR, (code, ran)
    assert len(web.requests) == seen_before


async def test_files_in_and_out_of_the_workspace(sandbox: WasmSandbox) -> None:
    info = await sandbox.upload("data/in.csv", b"a,b\n1,2\n")
    assert (info.path, info.type, info.size) == ("data/in.csv", "file", 8)
    ran = await sandbox.execute(
        "import csv\nrows = list(csv.reader(open('data/in.csv')))\n"
        "open('data/out.txt', 'w').write(str(len(rows)))"
    )
    assert ran.status is ExecutionStatus.OK
    assert await sandbox.download("data/out.txt") == b"2"
    listed = {f.path: f.type for f in await sandbox.list_files("", recursive=True)}
    assert listed == {"data": "directory", "data/in.csv": "file", "data/out.txt": "file"}
    await sandbox.remove_file("data")
    assert await sandbox.list_files() == []
    with pytest.raises(FileMissing):
        await sandbox.download("data/out.txt")
    with pytest.raises(InvalidPath):
        await sandbox.upload("../escape", b"x")
    with pytest.raises(InvalidPath):
        await sandbox.download("/etc/passwd")


async def test_a_file_too_large_to_carry_is_refused_and_the_session_carries_on(
    backend: WasmBackend,
) -> None:
    async with await backend.create(small_spec()) as sandbox:
        await sandbox.execute(f"open('big.bin', 'wb').write(b'x' * {MAX_FILE + 1})")
        with pytest.raises(FileTooLarge, match="over"):
            await sandbox.download("big.bin")
        with pytest.raises(FileTooLarge, match="over"):
            await sandbox.upload("big.bin", b"x" * (MAX_FILE + 1))
        assert (await sandbox.execute("1 + 1")).results[0].text == "2"


async def test_uploads_keep_the_workspace_within_its_quota(backend: WasmBackend) -> None:
    spec = small_spec(limits=ResourceLimits(memory_mb=1024, workspace_size_mb=1))
    async with await backend.create(spec) as sandbox:
        await sandbox.upload("a.bin", b"a" * 600_000)
        with pytest.raises(FileTooLarge, match="quota of 1048576 bytes"):
            await sandbox.upload("b.bin", b"b" * 600_000)
        await sandbox.upload("a.bin", b"c" * 900_000)  # replacing a file: its size goes
        assert [f.path for f in await sandbox.list_files()] == ["a.bin"]
        await sandbox.remove_file("a.bin")
        await sandbox.upload("b.bin", b"b" * 600_000)


async def test_an_upload_through_a_planted_link_is_refused(sandbox: WasmSandbox) -> None:
    await sandbox.execute(
        "import os\nopen('real.txt', 'w').write('r')\nos.symlink('real.txt', 'link')"
    )
    with pytest.raises(InvalidPath, match="symbolic link"):
        await sandbox.upload("link", b"through the link")
    assert (await sandbox.execute("open('real.txt').read()")).results[0].text == "'r'"


async def test_sleep_refuses_what_cpythons_refuses_and_a_cancel_is_the_codes_own(
    sandbox: WasmSandbox,
) -> None:
    for arg, error in (("'1'", "TypeError"), ("float('nan')", "ValueError"),
                       ("-1", "ValueError"), ("float('inf')", "OverflowError")):  # fmt: skip
        ran = await sandbox.execute(f"import time\ntime.sleep({arg})")
        assert ran.error is not None and ran.error.name == error, (arg, ran)
    own = await sandbox.execute(
        "import asyncio\nt = asyncio.ensure_future(asyncio.sleep(5))\nt.cancel()\nawait t"
    )
    assert own.status is ExecutionStatus.ERROR and own.error is not None, own
    assert own.error.name == "CancelledError", own  # not told as an interrupt


async def test_forged_messages_nested_deep_are_dropped_and_counted(backend: WasmBackend) -> None:
    """The worker may post anything: bodies nested 100,000 deep, for any id, cost nothing; an
    unreadable end of its own run ends that run as an error, and the session carries on. (A
    fresh sandbox, so its first run's id is 1: forged ends for later ids would only end the
    sandbox's own later runs early.)"""
    async with await backend.create(small_spec()) as sandbox:
        ran = await sandbox.execute(
            "import js\n"
            "deep = '[' * 100_000 + ']' * 100_000\n"
            "def post(kind, i):\n"
            "    fields = [['type', kind], ['id', i], ['body', deep]]\n"
            "    js.postMessage(js.Object.fromEntries(fields))\n"
            "for i in range(1, 500):\n"
            "    for kind in ('stream', 'execute_result', 'reply'):\n"
            "        post(kind, i)\n"
            "post('done', 1)"
        )
        assert ran.status is ExecutionStatus.ERROR and not ran.state_lost, ran
        assert ran.notice is not None and "malformed" in ran.notice, ran
        assert (await sandbox.execute("6 * 7")).results[0].text == "42"


async def test_python_only(sandbox: WasmSandbox) -> None:
    with pytest.raises(LanguageUnavailable, match="Python only"):
        await sandbox.execute("1", language="javascript")


async def test_closing_ends_deno_and_leaves_nothing(backend: WasmBackend, state_dir: Path) -> None:
    sandbox = await backend.create(small_spec())
    process = sandbox._process
    assert process is not None and process.returncode is None
    await sandbox.close()
    assert process.returncode is not None
    assert not (state_dir / "wasm" / sandbox.id).exists()


async def test_sandboxes_start_from_one_memory_snapshot_each_with_its_own_randomness(
    backend: WasmBackend, state_dir: Path
) -> None:
    """Taken once, before any session; what each restored session draws is its own."""
    drawn = []
    for _ in range(2):
        async with await backend.create(small_spec()) as made:
            assert made._snapshot is not None and made._snapshot.is_file()
            ran = await made.execute("import os, random\nrandom.random(), os.urandom(8).hex()")
            drawn.append(ran.results[0].text)
    assert drawn[0] != drawn[1]
    assert [p.name for p in (state_dir / "wasm-snapshots").iterdir()] == [made._snapshot.name]
    assert made._snapshot.parent == state_dir / "wasm-snapshots"


async def test_a_snapshot_that_will_not_load_starts_the_sandbox_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = WasmBackend(WasmBackendConfig(state_dir=tmp_path))
    async with await backend.create(small_spec()) as made:  # takes the snapshot
        snapshot = made._snapshot
    assert snapshot is not None
    snapshot.write_bytes(b"not a snapshot" * 1000)
    async with await backend.create(small_spec()) as cold:
        assert (await cold.execute("6 * 7")).results[0].text == "42"
    assert any("started cold" in r.getMessage() for r in caplog.records), caplog.text
    assert not snapshot.exists()  # dropped: the next start takes it again
    async with await backend.create(small_spec()) as again:
        assert again._snapshot == snapshot and snapshot.stat().st_size > 1 << 20


def _wheel(name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> bytes:
    """A pure-Python wheel made here (no index is reached)."""
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return out.getvalue()


@pytest.fixture(scope="module")
async def with_wheels(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> WasmBackend:
    require_backend("wasm")
    wheels = tmp_path_factory.mktemp("wheels")
    alpha = {"alpha_pkg/__init__.py": "from beta import B\nA = B + 1\n"}
    needs = ("beta>=1", "gamma; extra == 'docs'")
    (wheels / "alpha_pkg-1.0-py3-none-any.whl").write_bytes(
        _wheel("alpha_pkg", "1.0", alpha, requires=needs)
    )
    (wheels / "beta-2.0-py3-none-any.whl").write_bytes(
        _wheel("beta", "2.0", {"beta.py": "B = 41\n"})
    )
    (wheels / "evil-1.0-py3-none-any.whl").write_bytes(
        _wheel("evil", "1.0", {"../../outside.py": "X = 1\n"})
    )
    (wheels / "native-1.0-cp314-cp314-linux_x86_64.whl").write_bytes(b"not for wasm")
    return WasmBackend(WasmBackendConfig(state_dir=state_dir, wheels_dir=wheels))


async def test_a_wheel_from_the_operators_directory_installs_with_what_it_needs(
    with_wheels: WasmBackend,
) -> None:
    async with await with_wheels.create(small_spec()) as sandbox:
        ran = await sandbox.execute(
            "import micropip\nawait micropip.install('alpha-pkg')\nimport alpha_pkg\nalpha_pkg.A"
        )
        assert ran.results[0].text == "42", ran
        listed = await sandbox.execute("sorted(micropip.list())")
        assert "'alpha_pkg'" in (listed.results[0].text or "")
        for name in ("native", "nothing"):
            why = f"no package {name!r} among those this service offers"
            refused = await sandbox.execute(f"await micropip.install({name!r})")
            assert refused.error is not None and why in refused.error.value, refused
        evil = await sandbox.execute("await micropip.install('evil')")
        assert evil.error is not None and "outside site-packages" in evil.error.value, evil
        # The directory is read-only to it, and nothing else of the host opens.
        assert with_wheels.config.wheels_dir is not None
        where = with_wheels.config.wheels_dir.resolve()
        write = await sandbox.execute(
            f"import js\njs.Deno.writeTextFileSync('{where}/new.whl', 'x')"
        )
        assert write.error is not None and "NotCapable" in write.error.traceback, write.error
        assert not (where / "new.whl").exists()
        read = await sandbox.execute(f"js.Deno.statSync('{where}').isDirectory")
        assert read.results[0].text == "True", read  # it reads the directory: the wall holds


@pytest.fixture(scope="module")
def distribution(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An operator's Pyodide distribution: the pinned release with two packages' files of its
    own in it (one needing the other), and one more its lock lists without the file (as a
    release from npm lists numpy)."""
    require_backend("wasm")
    where = tmp_path_factory.mktemp("pyodide-full")
    for item in distribution_module.configured_dir().iterdir():
        if item.is_file():
            shutil.copy2(item, where / item.name)
    lock = json.loads((where / "pyodide-lock.json").read_text())
    for name, files, depends in (
        ("tinydep", {"tinydep/__init__.py": "D = 6\n"}, []),
        ("tinypkg", {"tinypkg/__init__.py": "from tinydep import D\nVALUE = D * 7\n"}, ["tinydep"]),
    ):
        data = _wheel(name, "1.0", files)
        file_name = f"{name}-1.0-py3-none-any.whl"
        (where / file_name).write_bytes(data)
        lock["packages"][name] = {
            "name": name, "version": "1.0", "file_name": file_name, "install_dir": "site",
            "sha256": hashlib.sha256(data).hexdigest(), "package_type": "package",
            "imports": [name], "depends": depends, "unvendored_tests": False, "tool": {},
        }  # fmt: skip
    lock["packages"]["ghostpkg"] = {**lock["packages"]["tinydep"], "name": "ghostpkg",
                                    "file_name": "ghostpkg-1.0-py3-none-any.whl"}  # fmt: skip
    (where / "pyodide-lock.json").write_text(json.dumps(lock))
    return where


async def test_a_package_of_the_operators_pyodide_distribution_loads_from_its_directory(
    distribution: Path, tmp_path: Path
) -> None:
    """Pyodide's own loading (its integrity check, what a package needs), from the operator's
    distribution; one it lists without the file is refused, and nothing reaches for Pyodide's
    CDN, not even Pyodide's own fallback."""
    backend = WasmBackend(WasmBackendConfig(state_dir=tmp_path, pyodide_dir=distribution))
    async with await backend.create(small_spec()) as sandbox:
        ran = await sandbox.execute(
            "import micropip\nawait micropip.install('tinypkg')\nimport tinypkg\ntinypkg.VALUE"
        )
        assert ran.results[0].text == "42", ran
        ghost = await sandbox.execute("await micropip.install('ghostpkg')")
        assert ghost.error is not None and "no package 'ghostpkg'" in ghost.error.value, ghost
        direct = await sandbox.execute(
            "import pyodide_js\nawait pyodide_js.loadPackage('ghostpkg')\n"
            "import importlib.util\nimportlib.util.find_spec('ghostpkg') is None"
        )
        said = direct.stdout + direct.stderr + str(direct.error)
        assert "jsdelivr" not in said and "http" not in said, said
        assert str(distribution) in said, said  # it looked in the directory, and only there


async def test_a_distribution_file_that_does_not_match_its_lock_is_refused(
    distribution: Path, tmp_path: Path
) -> None:
    """Pyodide's own check of a package's sha256 does not run under Deno: ours does, for the
    package and what it needs."""
    tampered = tmp_path / "pyodide"
    shutil.copytree(distribution, tampered)
    wheel = tampered / "tinydep-1.0-py3-none-any.whl"
    wheel.write_bytes(_wheel("tinydep", "1.0", {"tinydep/__init__.py": "D = 'not yours'\n"}))
    backend = WasmBackend(WasmBackendConfig(state_dir=tmp_path / "state", pyodide_dir=tampered))
    async with await backend.create(small_spec()) as sandbox:
        ran = await sandbox.execute("import micropip\nawait micropip.install('tinypkg')")
        assert ran.error is not None and "does not match the distribution's lock" in (
            ran.error.value
        ), ran
        gone = await sandbox.execute(
            "import importlib.util\nimportlib.util.find_spec('tinydep') is None"
        )
        assert gone.results[0].text == "True", gone


async def test_without_a_wheels_directory_nothing_installs(sandbox: WasmSandbox) -> None:
    ran = await sandbox.execute("import micropip\nawait micropip.install('beta')")
    assert ran.error is not None and "ask its operator" in ran.error.value


async def test_as_root_the_cpu_quota_holds_deno_and_its_group_goes_with_it(
    backend: WasmBackend,
) -> None:
    """In a cgroup of its own (as root on cgroup v1): the spec's CPU quota throttles a busy
    loop; the group's memory and thread caps leave Deno its own room; closing removes it."""
    from sandbox import cgroups

    if not cgroups.available():
        pytest.skip("cgroup v1 as root is not available here")
    spec = small_spec(limits=ResourceLimits(memory_mb=1024, cpus=0.25, pids=16))
    made = await backend.create(spec)
    try:
        cpu = cgroups.ROOT / "cpu" / cgroups.PARENT / made.id
        assert made._process is not None
        assert str(made._process.pid) in (cpu / "cgroup.procs").read_text().split()
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "25000"
        memory = cgroups.ROOT / "memory" / cgroups.PARENT / made.id
        assert int((memory / "memory.limit_in_bytes").read_text()) == (1024 + 1024) << 20
        before = _throttled(cpu)
        ran = await made.execute("import time\nt = time.time()\nwhile time.time() - t < 1: pass")
        assert ran.ok and _throttled(cpu) > before
    finally:
        await made.close()
    assert not cpu.exists() and not memory.exists()


def _throttled(group: Path) -> int:
    for line in (group / "cpu.stat").read_text().splitlines():
        if line.startswith("nr_throttled"):
            return int(line.split()[1])
    raise AssertionError("no nr_throttled in cpu.stat")


async def test_a_start_cancelled_again_and_again_leaves_nothing(
    backend: WasmBackend, state_dir: Path
) -> None:
    """A start cancelled while Deno comes up, and cancelled again at each step of its undoing
    (as a task group shutting down does): its process and its directory still go."""
    root = state_dir / backend.name

    def made_now() -> set[Path]:
        return (set(root.iterdir()) if root.is_dir() else set()) - before

    before: set[Path] = set()
    before = made_now()
    making = asyncio.ensure_future(backend.create(small_spec()))
    async with asyncio.timeout(60):  # its socket bound: Deno is being started
        while not any((d / "s").exists() for d in made_now()):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    (made,) = made_now()
    async with asyncio.timeout(60):  # Deno itself running
        while not host_processes_with(str(made)):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    async with asyncio.timeout(60):
        while not making.done():  # cancelled at each of its steps
            making.cancel()
            await asyncio.sleep(0)
    assert making.cancelled()
    assert not made.exists()
    assert host_processes_with(str(made)) == []
