"""What an execution returns, on every backend: state, streams, rich results, errors, limits."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time

import pytest
from PIL import Image

from code_interpreter_wire.results import (
    ExecutionStatus,
    OutputEvent,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)
from code_interpreter_wire.spec import ResourceLimits
from sandbox import Backend, Sandbox, cgroups
from sandbox.backends.local import LocalBackend
from tests.conftest import small_spec


async def test_state_persists_between_calls(sandbox: Sandbox) -> None:
    first = await sandbox.execute("import math\nx = 20\nimport os; os.makedirs('d', exist_ok=True)")
    assert first.status is ExecutionStatus.OK, first.error
    await sandbox.execute("os.chdir('d')")
    second = await sandbox.execute("math.floor(x + 1.5), os.getcwd()")
    assert second.ok
    assert second.text == "(21, '/workspace/d')"
    assert second.execution_count == 3


async def test_value_and_prints(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7")
    assert ex.stdout == "out\n"
    assert ex.stderr == "err\n"
    assert ex.text == "42"
    assert ex.main_result is not None and ex.main_result.is_main_result
    assert ex.duration_s > 0


async def test_streaming_in_order_and_as_it_happens(sandbox: Sandbox) -> None:
    code = (
        "import sys, time\n"
        "from IPython.display import display, HTML\n"
        "print('one', flush=True)\n"
        "print('two', file=sys.stderr, flush=True)\n"
        "display(HTML('<b>three</b>'))\n"
        "time.sleep(1.5)\n"
        "print('four')\n"
    )
    seen: list[tuple[float, OutputEvent]] = []
    async for event in sandbox.stream(code):
        seen.append((time.monotonic(), event))
    kinds = [e.type for _, e in seen]
    assert kinds == ["stdout", "stderr", "result", "stdout", "done"]
    texts = [
        e.text
        if isinstance(e, StdoutEvent | StderrEvent)
        else e.result.html
        if isinstance(e, ResultEvent)
        else None
        for _, e in seen
    ]
    assert texts[:4] == ["one\n", "two\n", "<b>three</b>", "four\n"]
    # The first line reached us while the code was still sleeping, not at the end.
    assert seen[-1][0] - seen[0][0] > 1.0


async def test_on_event_callback_sees_what_the_execution_holds(sandbox: Sandbox) -> None:
    events: list[OutputEvent] = []

    async def sink(event: OutputEvent) -> None:
        events.append(event)

    ex = await sandbox.execute("for i in range(3): print(i)\n'end'", on_event=sink)
    streamed = "".join(e.text for e in events if isinstance(e, StdoutEvent))
    assert streamed == ex.stdout == "0\n1\n2\n"
    assert [e.result.text for e in events if isinstance(e, ResultEvent)] == ["'end'"]


async def test_each_mime_type(sandbox: Sandbox) -> None:
    code = r"""
from IPython.display import display, HTML, Markdown, SVG, JSON, Latex, Image
import io
from PIL import Image as PILImage
buf = io.BytesIO(); PILImage.new('RGB', (4, 3), 'red').save(buf, format='JPEG')
display(HTML('<i>h</i>'))
display(Markdown('# m'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"></svg>'))
display(JSON({'a': [1, 2]}))
display(Latex(r'$x^2$'))
display(Image(data=buf.getvalue(), format='jpeg'))
"""
    ex = await sandbox.execute(code)
    assert ex.ok, ex.error
    html, md, svg, js, latex, jpeg = ex.results
    assert html.html == "<i>h</i>"
    assert md.markdown == "# m"
    assert svg.svg is not None and svg.svg.startswith("<svg")
    assert js.json_data == {"a": [1, 2]}
    assert latex.latex == "$x^2$"
    assert jpeg.jpeg is not None
    assert Image.open(io.BytesIO(base64.b64decode(jpeg.jpeg))).size == (4, 3)
    assert not any(r.is_main_result for r in ex.results)
    assert [a.mime_type for a in ex.artifacts] == ["image/svg+xml", "image/jpeg"]
    dumped = ex.model_dump(mode="json")
    assert dumped["results"][3]["json"] == {"a": [1, 2]}


async def test_matplotlib_figure_comes_back_as_png(sandbox: Sandbox) -> None:
    shown = await sandbox.execute(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()"
    )
    assert shown.ok, shown.error
    assert len(shown.results) == 1 and shown.results[0].png
    image = Image.open(io.BytesIO(shown.artifacts[0].data))
    image.verify()
    assert image.format == "PNG" and image.size[0] > 100

    as_value = await sandbox.execute("fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\nfig")
    pngs = [r for r in as_value.results if r.png]
    assert pngs, as_value.results
    # The same figure gives the same bytes, so the artifact id is stable.
    again = await sandbox.execute("fig")
    assert again.artifacts[0].id == as_value.artifacts[0].id


async def test_pandas_dataframe_has_html_and_text(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    main = ex.main_result
    assert main is not None
    assert main.html is not None and "<table" in main.html
    assert main.text is not None and "a  b" in main.text


async def test_exception_with_clean_traceback(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert ex.status is ExecutionStatus.ERROR
    assert ex.stdout == "before\n"
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert "return 1 / 0" in ex.error.traceback
    assert "\x1b[" not in ex.error.traceback
    assert (await sandbox.execute("1 + 1")).text == "2"


async def test_syntax_error(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("def broken(:\n  pass")
    assert ex.status is ExecutionStatus.ERROR
    assert ex.error is not None and ex.error.name == "SyntaxError"


async def test_timeout_interrupts_and_keeps_state(backend: Backend) -> None:
    async with await backend.create(small_spec()) as sb:
        await sb.execute("kept = 'yes'")
        ex = await sb.execute("while True:\n    pass", timeout_s=1.0)
        assert ex.status is ExecutionStatus.TIMEOUT
        assert not ex.state_lost
        assert ex.error is not None and ex.error.name == "ExecutionTimeout"
        assert "state is kept" in ex.error.value
        assert (await sb.execute("kept")).text == "'yes'"


async def test_timeout_that_swallows_interrupts_restarts_the_kernel(backend: Backend) -> None:
    async with await backend.create(small_spec(interrupt_grace_s=1.0)) as sb:
        await sb.upload("kept.txt", b"file survives")
        await sb.execute("lost = 1")
        code = (
            "import time\n"
            "while True:\n"
            "    try:\n"
            "        time.sleep(0.05)\n"
            "    except KeyboardInterrupt:\n"
            "        print('ignored', flush=True)\n"
        )
        ex = await sb.execute(code, timeout_s=1.0)
        assert ex.status is ExecutionStatus.TIMEOUT
        assert ex.state_lost
        assert ex.error is not None and "restarted" in ex.error.value
        assert "ignored" in ex.stdout
        after = await sb.execute("'lost' in globals(), open('kept.txt').read()")
        assert after.ok and after.text == "(False, 'file survives')"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import os; os._exit(3)", "exited with code 3"),
        ("import ctypes; ctypes.string_at(0)", "SIGSEGV"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
)
async def test_kernel_death_is_reported_and_recovered(
    backend: Backend, code: str, reason: str
) -> None:
    async with await backend.create(small_spec()) as sb:
        await sb.execute("before = 1")
        ex = await sb.execute(code, timeout_s=30)
        assert ex.status is ExecutionStatus.KERNEL_DIED
        assert ex.state_lost
        assert ex.error is not None and ex.error.name == "KernelDied"
        assert reason in ex.error.value
        after = await sb.execute("'before' in globals(), 2 + 2")
        assert after.ok and after.text == "(False, 4)"


async def test_kernel_death_while_idle_is_told_to_the_next_call(sandbox: Sandbox) -> None:
    # A thread kills the kernel after the execution has finished.
    ex = await sandbox.execute(
        "import threading, os, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(9)), daemon=True).start()\n"
        "x = 1"
    )
    assert ex.ok
    await asyncio.sleep(2.0)
    after = await sandbox.execute("'x' in globals()")
    assert after.ok and after.text == "False"
    assert after.state_lost
    assert after.notice is not None and "exited with code 9" in after.notice


def aggregate_memory_limit(backend: Backend) -> bool:
    """Docker always has a memory cgroup; the local backend has one as root on cgroup v1."""
    if isinstance(backend, LocalBackend):
        return cgroups.available() and backend.config.use_cgroups
    return True


async def test_out_of_memory_is_reported_as_such(backend: Backend) -> None:
    async with await backend.create(small_spec(limits=ResourceLimits(memory_mb=256))) as sb:
        ex = await sb.execute(
            "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))",
            timeout_s=60,
        )
        assert ex.error is not None
        if aggregate_memory_limit(backend):
            assert ex.status is ExecutionStatus.KERNEL_DIED
            assert "out of memory" in ex.error.value
        else:  # per-process rlimit: the allocation fails instead
            assert ex.error.name == "MemoryError"
        assert (await sb.execute("1 + 1")).text == "2"


async def test_one_huge_allocation_fails_cleanly(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("b = bytearray(64 * 1024**3)", timeout_s=60)
    assert ex.status in (ExecutionStatus.ERROR, ExecutionStatus.KERNEL_DIED)
    assert ex.error is not None
    assert ex.error.name == "MemoryError" or "memory" in ex.error.value
    assert (await sandbox.execute("1")).ok


async def test_fork_bomb_is_contained(backend: Backend) -> None:
    if isinstance(backend, LocalBackend) and os.geteuid() != 0:
        pytest.skip("the local backend limits processes only as root (see the README)")
    limits = ResourceLimits(pids=64)
    async with await backend.create(small_spec(limits=limits)) as sb:
        ex = await sb.execute(
            "import os, time\n"
            "children, failed = 0, None\n"
            "for _ in range(500):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n"
            "        children += 1\n"
            "    except OSError as e:\n"
            "        failed = e.strerror; break\n"
            "(children < 64, failed)",
            timeout_s=60,
        )
        assert ex.ok, ex.error
        assert ex.text is not None and ex.text.startswith("(True, '")
        await sb.restart()  # the children go with the old kernel
        assert (await sb.execute("2 + 2")).text == "4"


async def test_stdin_fails_fast(sandbox: Sandbox) -> None:
    ex = await sandbox.execute("input('name? ')", timeout_s=10)
    assert ex.status is ExecutionStatus.ERROR
    assert ex.error is not None and ex.error.name == "StdinNotImplementedError"
    ex = await sandbox.execute("import sys; sys.stdin.read()", timeout_s=10)
    assert ex.status is ExecutionStatus.ERROR
    assert ex.error is not None and "stdin is not available" in ex.error.value


async def test_output_cap_keeps_head_and_tail(backend: Backend) -> None:
    async with await backend.create(small_spec(output_limit_chars=10_000)) as sb:
        ex = await sb.execute(
            "import sys\n"
            "print('FIRST')\n"
            "for i in range(200_000): print(i)\n"
            "print('LAST')\n"
            "sys.stderr.write('e' * 50_000)\n"
        )
        assert ex.ok
        produced = len("FIRST\n") + sum(len(f"{i}\n") for i in range(200_000)) + len("LAST\n")
        assert ex.stdout.startswith("FIRST\n0\n1\n")
        assert ex.stdout.endswith("199999\nLAST\n")
        assert ex.stdout_dropped == produced - 10_000
        assert f"{ex.stdout_dropped} characters of stdout dropped" in ex.stdout
        assert ex.stderr_dropped == 40_000
        assert len(ex.stdout) < 10_000 + 200


async def test_per_execution_env_and_cwd(backend: Backend) -> None:
    async with await backend.create(small_spec(env={"SESSION_VAR": "s"})) as sb:
        await sb.execute("import os; os.makedirs('sub/dir', exist_ok=True)")
        ex = await sb.execute(
            "import os; os.environ.get('CALL_VAR'), os.environ['SESSION_VAR'], os.getcwd()",
            env={"CALL_VAR": "c"},
            cwd="/workspace/sub/dir",
        )
        assert ex.text == "('c', 's', '/workspace/sub/dir')", ex.error
        assert ex.execution_count == 2  # the scoping is invisible
        after = await sb.execute("os.environ.get('CALL_VAR'), os.getcwd()")
        assert after.text == "(None, '/workspace')"
        bad = await sb.execute("1", cwd="/does/not/exist")
        assert bad.status is ExecutionStatus.ERROR
        assert bad.error is not None and bad.error.name == "FileNotFoundError"


async def test_interrupt_cancels_the_running_execution(sandbox: Sandbox) -> None:
    task = asyncio.ensure_future(sandbox.execute("import time\ntime.sleep(30)"))
    await asyncio.sleep(1.0)
    assert sandbox.is_busy
    assert await sandbox.interrupt()
    ex = await task
    assert ex.status is ExecutionStatus.CANCELLED
    assert not ex.state_lost
    assert not await sandbox.interrupt()  # nothing runs any more


async def test_restart_loses_state_keeps_files(sandbox: Sandbox) -> None:
    await sandbox.execute("v = 1\nopen('f.txt', 'w').write('kept')")
    await sandbox.restart()
    ex = await sandbox.execute("'v' in globals(), open('f.txt').read()")
    assert ex.text == "(False, 'kept')"


async def test_restart_during_execution_cancels_it(sandbox: Sandbox) -> None:
    task = asyncio.ensure_future(sandbox.execute("import time\ntime.sleep(30)"))
    await asyncio.sleep(1.0)
    await sandbox.restart()
    ex = await task
    assert ex.status is ExecutionStatus.CANCELLED and ex.state_lost
    assert (await sandbox.execute("3")).text == "3"


async def test_concurrent_calls_queue_in_order(sandbox: Sandbox) -> None:
    await sandbox.execute("order = []")
    calls = [
        sandbox.execute(f"import time; time.sleep(0.1); order.append({i}); {i}") for i in range(5)
    ]
    results = await asyncio.gather(*calls)
    assert [r.text for r in results] == ["0", "1", "2", "3", "4"]
    assert (await sandbox.execute("order")).text == "[0, 1, 2, 3, 4]"


async def test_caller_that_leaves_does_not_leave_the_kernel_busy(sandbox: Sandbox) -> None:
    task = asyncio.ensure_future(sandbox.execute("import time\ntime.sleep(60)"))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ex = await asyncio.wait_for(sandbox.execute("'free'"), timeout=30)
    assert ex.text == "'free'"


async def test_a_consumer_that_stops_reading_a_stream_interrupts_the_code(
    sandbox: Sandbox,
) -> None:
    stream = sandbox.stream("import time\nprint('go', flush=True)\ntime.sleep(60)")
    async for event in stream:
        assert event.type == "stdout"
        break
    await stream.aclose()  # type: ignore[attr-defined]
    ex = await asyncio.wait_for(sandbox.execute("'next'"), timeout=30)
    assert ex.text == "'next'"


async def test_env_alone_and_cwd_alone(sandbox: Sandbox) -> None:
    only_env = await sandbox.execute("import os; os.environ['ONLY']", env={"ONLY": "e'\"\\n"})
    assert only_env.ok, only_env.error
    assert only_env.text == repr("e'\"\\n")
    only_cwd = await sandbox.execute("import os; os.getcwd()", cwd="/tmp")
    assert only_cwd.text == "'/tmp'"


async def test_a_cancelled_call_does_not_poison_the_next(backend: Backend) -> None:
    async with await backend.create(small_spec(interrupt_grace_s=1.0)) as sb:
        stubborn = (
            "import time\n"
            "while True:\n"
            "    try:\n"
            "        time.sleep(0.05)\n"
            "    except KeyboardInterrupt:\n"
            "        pass\n"
        )
        task = asyncio.ensure_future(sb.execute(stubborn, env={"SCOPED": "1"}))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await asyncio.wait_for(
            sb.execute("import os; str(os.environ.get('SCOPED'))", timeout_s=20), 30
        )
        assert after.ok, after.error  # not blamed for the stubborn code
        assert after.text == "'None'"
        assert after.state_lost and after.notice is not None and "went away" in after.notice

        polite = asyncio.ensure_future(
            sb.execute("import time; time.sleep(30)", env={"SCOPED": "2"})
        )
        await asyncio.sleep(1.0)
        polite.cancel()
        with pytest.raises(asyncio.CancelledError):
            await polite
        again = await sb.execute("import os; str(os.environ.get('SCOPED'))")
        assert again.text == "'None'" and not again.state_lost


async def test_malformed_rich_output_is_kept_not_fatal(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "from IPython.display import display\n"
        "display({'image/png': ['not', 'a', 'string']}, raw=True)\n"
        "display({'image/png': 'not base64!'}, raw=True)\n"
        "'fine'"
    )
    assert ex.ok, ex.error
    assert ex.text == "'fine'"
    assert ex.results[0].extra == {"image/png": ["not", "a", "string"]}
    assert ex.artifacts == []  # the undecodable PNG is skipped, not fatal


async def test_shells_find_the_kernels_python_login_or_not(sandbox: Sandbox) -> None:
    """Commands see the kernel's interpreter and packages: agent frameworks run them through a
    login shell (`sh -lc`, `bash -l`), which resets PATH from /etc/profile where there is one."""
    execution = await sandbox.execute(
        "import subprocess\n"
        "probe = \"python3 -c 'import pandas; print(pandas.__name__)'\"\n"
        "for shell in (['sh', '-c'], ['sh', '-lc'], ['bash', '-c'], ['bash', '-lc']):\n"
        "    done = subprocess.run([*shell, probe], capture_output=True, text=True)\n"
        "    print(shell[-1], shell[0], done.returncode, done.stdout.strip(), done.stderr[-300:])\n"
    )
    assert execution.error is None, execution.error
    lines = execution.stdout.splitlines()
    assert len(lines) == 4
    for line in lines:
        assert line.split()[2:4] == ["0", "pandas"], execution.stdout
