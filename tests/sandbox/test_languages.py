"""Every language's kernel behaves as Python's does, on every backend (Docker: the full image).

For each language: state across calls, stdout, a rich result, an error with its traceback, a
time limit that interrupts (and keeps the kernel's state), a kernel death detected and recovered,
per-call environment variables that do not stick. Then: Python and R working on the same file of
one workspace; languages started only on first use; unknown and missing languages refused with
the names of those there are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from code_interpreter_wire.errors import LanguageUnavailable, UnknownLanguage
from code_interpreter_wire.languages import LANGUAGES
from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from sandbox.backends.kernel_sandbox import KernelSandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec
from tests.sandbox.polyglot import polyglot_sandbox

pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Case:
    set_state: str  # leaves 41 in a variable
    read_state: str  # prints that variable plus one: "42"
    rich: str  # displays HTML holding <b>hi</b>
    fail: str  # raises an error whose text holds "boom"
    error_name: str
    spin: str  # runs forever
    die: str  # kills its own kernel
    show_env: str  # prints $CIR_LANG_VAR (nothing if unset)


CASES = {
    "python": Case(
        "v = 41",
        "print(v + 1)",
        "from IPython.display import HTML; HTML('<b>hi</b>')",
        "raise ValueError('boom')",
        "ValueError",
        "while True: pass",
        "import os; os.kill(os.getpid(), 9)",
        "import os; print(os.environ.get('CIR_LANG_VAR', ''))",
    ),
    "bash": Case(
        "v=41",
        "echo $((v + 1))",
        "echo '<b>hi</b>' | displayHTML",
        "echo boom >&2; false",
        "",  # bash_kernel names no error: its value is the exit status
        "sleep 1000",
        "kill -9 $PPID",
        'echo "${CIR_LANG_VAR:-}"',
    ),
    "r": Case(
        "v <- 41",
        "cat(v + 1, '\\n')",
        "IRdisplay::display_html('<b>hi</b>')",
        "stop('boom')",
        "ERROR",
        "while (TRUE) {}",
        "tools::pskill(Sys.getpid(), 9)",
        "cat(Sys.getenv('CIR_LANG_VAR'), '\\n')",
    ),
    "javascript": Case(
        "var v = 41;",
        "console.log(v + 1)",
        "Deno.jupyter.html`<b>hi</b>`",
        "throw new Error('boom')",
        "Error",
        "while (true) {}",
        "Deno.exit(3)",
        "console.log(Deno.env.get('CIR_LANG_VAR') ?? '')",
    ),
    "typescript": Case(
        "var v: number = 41;",
        "console.log(v + 1)",
        "Deno.jupyter.html`<b>hi</b>`",
        "throw new Error('boom')",
        "Error",
        "while (true) {}",
        "Deno.exit(3)",
        "console.log(Deno.env.get('CIR_LANG_VAR') ?? '')",
    ),
    "java": Case(
        "int v = 41;",
        "System.out.println(v + 1);",
        'display("<b>hi</b>", "text/html");',
        'throw new RuntimeException("boom");',
        "RuntimeException",
        "while (true) {}",
        "Runtime.getRuntime().halt(1);",
        'System.out.println(java.util.Objects.toString(System.getenv("CIR_LANG_VAR"), ""));',
    ),
}
assert set(CASES) == set(LANGUAGES)


@pytest.fixture(scope="module")
async def polyglot(backend: Backend) -> AsyncIterator[Sandbox]:
    """A sandbox with every language: the host's kernels (local), the full image (Docker)."""
    async with polyglot_sandbox(backend, LANGUAGES) as sb:
        yield sb


@pytest.mark.parametrize("language", list(CASES))
async def test_a_language_keeps_state_prints_displays_and_fails_with_a_traceback(
    polyglot: Sandbox, language: str
) -> None:
    case = CASES[language]
    first = await polyglot.execute(case.set_state, language=language, timeout_s=120)
    assert first.status is ExecutionStatus.OK, first
    read = await polyglot.execute(case.read_state, language=language)
    assert read.status is ExecutionStatus.OK, read
    assert read.stdout.strip() == "42"

    rich = await polyglot.execute(case.rich, language=language)
    assert rich.status is ExecutionStatus.OK, rich
    assert any(r.html and "<b>hi</b>" in r.html for r in rich.results), rich.results

    failed = await polyglot.execute(case.fail, language=language)
    assert failed.status is ExecutionStatus.ERROR, failed
    assert failed.error is not None
    assert failed.error.name == case.error_name
    told = failed.error.value + failed.error.traceback + failed.stdout + failed.stderr
    assert "boom" in told or language == "bash", failed
    if language not in ("bash",):
        assert failed.error.traceback, f"{language}'s error came without a traceback"
    # The error did not cost the kernel its state.
    again = await polyglot.execute(case.read_state, language=language)
    assert again.stdout.strip() == "42"


@pytest.mark.parametrize("language", list(CASES))
async def test_a_time_limit_interrupts_and_the_kernel_goes_on(
    polyglot: Sandbox, language: str
) -> None:
    case = CASES[language]
    await polyglot.execute(case.set_state, language=language, timeout_s=120)
    spun = await polyglot.execute(case.spin, language=language, timeout_s=2)
    assert spun.status is ExecutionStatus.TIMEOUT, spun
    after = await polyglot.execute(case.read_state, language=language, timeout_s=60)
    assert after.status is ExecutionStatus.OK, after
    assert after.stdout.strip() == "42", f"{language} lost its state to the interrupt: {after}"


@pytest.mark.parametrize("language", list(CASES))
async def test_a_dead_kernel_is_told_and_replaced(polyglot: Sandbox, language: str) -> None:
    case = CASES[language]
    await polyglot.execute(case.set_state, language=language, timeout_s=120)
    died = await polyglot.execute(case.die, language=language, timeout_s=60)
    assert died.status is ExecutionStatus.KERNEL_DIED, died
    assert died.state_lost
    fresh = await polyglot.execute(case.set_state, language=language, timeout_s=120)
    assert fresh.status is ExecutionStatus.OK, fresh
    # The other languages' kernels were not touched by this one's death.
    python = await polyglot.execute("print('python lives')")
    assert python.stdout == "python lives\n"


@pytest.mark.parametrize("language", list(CASES))
async def test_per_call_variables_reach_the_kernel_and_do_not_stick(
    polyglot: Sandbox, language: str
) -> None:
    case = CASES[language]
    value = 'it\'s "quoted" $HOME `x` \\ and ünïcode'
    inside = await polyglot.execute(
        case.show_env, language=language, env={"CIR_LANG_VAR": value}, timeout_s=120
    )
    assert inside.status is ExecutionStatus.OK, inside
    assert inside.stdout.strip() == value
    after = await polyglot.execute(case.show_env, language=language)
    assert after.stdout.strip() == ""


async def test_python_and_r_work_on_the_same_workspace_file(polyglot: Sandbox) -> None:
    wrote = await polyglot.execute(
        "import pandas as pd\npd.DataFrame({'x': [1, 2, 3]}).to_csv('shared.csv', index=False)"
    )
    assert wrote.status is ExecutionStatus.OK, wrote
    r = await polyglot.execute(
        "d <- read.csv('shared.csv'); d$y <- d$x * 10; "
        "write.csv(d, 'from_r.csv', row.names = FALSE); cat(sum(d$y), '\\n')",
        language="r",
        timeout_s=120,
    )
    assert r.status is ExecutionStatus.OK, r
    assert r.stdout.strip() == "60"
    back = await polyglot.execute("print(pd.read_csv('from_r.csv')['y'].tolist())")
    assert back.stdout == "[10, 20, 30]\n"
    shell = await polyglot.execute("cat from_r.csv | wc -l", language="bash")
    assert shell.stdout.strip() == "4"


async def test_a_language_starts_on_first_use_only(backend: Backend) -> None:
    spec = small_spec(image=FULL_IMAGE) if backend.capabilities.images else small_spec()
    sb = await backend.create(spec)
    try:
        assert isinstance(sb, KernelSandbox)
        assert sb.started_languages == ["python"]
        await sb.execute("echo hi", language="sh")  # an alias
        assert sb.started_languages == ["python", "bash"]
        await sb.restart("bash")
        gone = await sb.execute("echo ${v:-unset}", language="bash")
        assert gone.stdout == "unset\n"
    finally:
        await sb.close()


async def test_unknown_and_missing_languages_are_refused_with_the_names_there_are(
    polyglot: Sandbox, backend: Backend
) -> None:
    with pytest.raises(UnknownLanguage, match=r"cobol.*python, bash"):
        await polyglot.execute("DISPLAY 'HI'.", language="cobol")
    if backend.name == "docker":  # the default image has Python and Bash only
        sb = await backend.create(small_spec())
        try:
            assert sb.languages == ["python", "bash"]
            with pytest.raises(LanguageUnavailable, match=r"'r' is not installed.*python, bash"):
                await sb.execute("1", language="R")
        finally:
            await sb.close()


async def test_the_memory_limit_binds_the_sandbox_not_each_kernel(backend: Backend) -> None:
    """Two kernels of one sandbox cannot each take most of its memory: the limit is the
    sandbox's (one cgroup for the local sandbox; one parent cgroup for Docker's containers)."""
    from sandbox import cgroups

    if not cgroups.available():
        pytest.skip("needs root and cgroup v1 (as in CI) for the sandbox-wide memory limit")
    limits = small_spec().limits.model_copy(update={"memory_mb": 600})
    image = {"image": FULL_IMAGE} if backend.capabilities.images else {}
    sb = await backend.create(small_spec(limits=limits, **image))
    try:
        held = await sb.execute("import numpy as np; a = np.ones(400 * 2**20 // 8); a[0] = 2")
        assert held.status is ExecutionStatus.OK, held
        r = await sb.execute(
            "x <- numeric(400 * 2^20 / 8); x[] <- 1; cat(length(x))", language="r", timeout_s=120
        )
        python = await sb.execute("print(a[0])")
        both_hold = r.status is ExecutionStatus.OK and python.stdout == "2.0\n"
        assert not both_hold, "two kernels held 800 MB in a sandbox of 600 MB"
        assert r.status is ExecutionStatus.KERNEL_DIED or python.status is not ExecutionStatus.OK
    finally:
        await sb.close()


async def test_r_plots_and_data_frames_come_back_as_an_image_and_a_table(
    polyglot: Sandbox,
) -> None:
    plotted = await polyglot.execute("plot(1:10)", language="r", timeout_s=120)
    assert plotted.status is ExecutionStatus.OK, plotted
    assert any(r.png for r in plotted.results), plotted.results
    table = await polyglot.execute("head(mtcars, 3)", language="r")
    assert table.status is ExecutionStatus.OK, table
    (frame,) = table.results
    assert frame.html is not None and "<table" in frame.html
    assert frame.text is not None and "Mazda RX4" in frame.text
