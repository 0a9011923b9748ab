"""Review (issue 16): per-call variables and working directory in other languages' kernels
(sandbox/kernel/scopes.py), with values the service accepts (code_interpreter_wire/rest.py: any text
without NUL, up to 65 536 characters).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.errors import ScopeRefused
from code_interpreter_wire.results import ExecutionStatus
from sandbox import Backend, Sandbox
from sandbox.image_labels import FULL_IMAGE
from tests.conftest import small_spec

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
async def polyglot(backend: Backend) -> AsyncIterator[Sandbox]:
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(env={"CIR_REVIEW_VAR": "before"}, **image))
    try:
        yield sb
    finally:
        await sb.close()


@pytest.mark.parametrize(
    "value",
    ["plain", "a\x03b", "\x01echo INJECTED; #", "carriage\rreturn", "del\x7fete", "esc\x1b[2Jx"],
    ids=["plain", "ctrl-c", "ctrl-a", "cr", "del", "esc"],
)
async def test_bash_per_call_values_with_control_characters_arrive_verbatim(
    polyglot: Sandbox, value: str
) -> None:
    """bash_kernel types code into an interactive bash on a terminal: a control character
    inside the quoted value is read as a key (^C interrupts, ^A moves the cursor, DEL erases,
    CR becomes a newline) instead of being part of the value."""
    await polyglot.execute("kept=41", language="bash", timeout_s=120)
    shown = await polyglot.execute(
        "printf '[%s]' \"$V\" | od -An -tx1 | tr -d ' \\n'",
        language="bash",
        env={"V": value},
        timeout_s=20,
    )
    assert shown.status is ExecutionStatus.OK, shown
    expected = ("[" + value + "]").encode().hex()
    assert shown.stdout.strip() == expected, f"bash saw {shown.stdout!r}, not {expected!r}"
    state = await polyglot.execute("echo $kept", language="bash")
    assert state.stdout == "41\n", f"the bash kernel lost its state: {state}"


@pytest.mark.parametrize("language", ["python", "bash", "r", "javascript"])
async def test_a_per_call_directory_does_not_undo_the_codes_own_variable_changes(
    polyglot: Sandbox, language: str
) -> None:
    """A call with a working directory and no variables restores what it changed (the
    directory) and nothing else, as Python's does. R's scope snapshots `Sys.getenv(c())`, which
    is every variable, and restores all of them after the call."""
    change = {
        "python": "import os; os.environ['CIR_REVIEW_VAR'] = 'after_' + 'python'",
        "bash": "export CIR_REVIEW_VAR=after_bash",
        "r": "Sys.setenv(CIR_REVIEW_VAR = 'after_r')",
        "javascript": "Deno.env.set('CIR_REVIEW_VAR', 'after_javascript')",
    }[language]
    show = {
        "python": "import os; print(os.environ['CIR_REVIEW_VAR'])",
        "bash": "echo $CIR_REVIEW_VAR",
        "r": "cat(Sys.getenv('CIR_REVIEW_VAR'), '\\n', sep = '')",
        "javascript": "console.log(Deno.env.get('CIR_REVIEW_VAR'))",
    }[language]
    changed = await polyglot.execute(change, language=language, cwd="/tmp", timeout_s=120)
    assert changed.status is ExecutionStatus.OK, changed
    after = await polyglot.execute(show, language=language)
    assert after.stdout == f"after_{language}\n", f"{language}: the code's own change was undone"


async def test_a_long_per_call_value_does_not_wreck_the_java_kernel(polyglot: Sandbox) -> None:
    """22 000 euro signs: well under the service's 65 536 characters, but 66 000 bytes, over
    the 65 535 bytes a Java string constant may hold. The scope pastes the value as one literal;
    JShell then leaves the kernel answering every later call `ok` with no output at all."""
    await polyglot.execute("int v = 41;", language="java", timeout_s=120)
    await polyglot.execute(
        'System.out.println(System.getenv("V").length());',
        language="java",
        env={"V": "€" * 22_000},
        timeout_s=120,
    )
    after = await polyglot.execute("System.out.println(v + 1);", language="java", timeout_s=60)
    assert after.status is ExecutionStatus.OK, after
    assert after.stdout == "42\n", f"the Java kernel no longer answers: {after}"


async def test_java_has_the_variables_as_system_properties_too(polyglot: Sandbox) -> None:
    """As E2B's Java kernel: the sandbox's variables from its start, those set while it runs,
    and a call's for that call alone (a long one too), each also `System.getProperty`."""
    both = 'System.getenv("{0}") + "/" + System.getProperty("{0}", "none")'
    started = await polyglot.execute(both.format("CIR_REVIEW_VAR"), language="java", timeout_s=120)
    assert "before/before" in (started.text or ""), started
    await polyglot.set_env({"CIR_LATER": "later"})
    later = await polyglot.execute(both.format("CIR_LATER"), language="java", timeout_s=60)
    assert "later/later" in (later.text or ""), later
    long = "€" * 22_000
    length = (
        'System.getProperty("V").length() + " "'
        ' + System.getProperty("V").equals(System.getenv("V"))'
    )
    called = await polyglot.execute(length, language="java", env={"V": long}, timeout_s=60)
    assert "22000 true" in (called.text or ""), called
    after = await polyglot.execute(both.format("V"), language="java", timeout_s=60)
    assert "null/none" in (after.text or ""), after


async def test_a_java_kernel_starts_with_many_long_variables(backend: Backend) -> None:
    """Its variables become properties by code that names none of them: 600 names of 200
    characters (120 KB of names, past what one environment string may hold) start it."""
    names = {f"V{i:03d}_" + "x" * 195: str(i) for i in range(600)}
    image = {"image": FULL_IMAGE} if backend.name == "docker" else {}
    sb = await backend.create(small_spec(env=names, **image))
    try:
        last = next(reversed(names))
        got = await sb.execute(f'System.getProperty("{last}")', language="java", timeout_s=120)
        assert got.status is ExecutionStatus.OK and "599" in (got.text or ""), got
    finally:
        await sb.close()


async def test_a_bash_call_whose_directory_is_missing_leaves_pwd_alone(polyglot: Sandbox) -> None:
    before = await polyglot.execute("echo $PWD", language="bash", timeout_s=60)
    failed = await polyglot.execute("echo in", language="bash", cwd="/nonexistent/dir")
    assert failed.status is not ExecutionStatus.OK or "in" not in failed.stdout, failed
    after = await polyglot.execute("echo $PWD", language="bash", timeout_s=60)
    assert after.stdout == before.stdout, (before, after)


async def test_a_bash_per_call_value_never_runs_as_a_command(polyglot: Sandbox) -> None:
    """^A in a value moves bash's line editor to the start of the line being typed: what
    follows in the value is typed before `if [ -n ...`, and runs as a command."""
    await polyglot.execute("rm -f /tmp/injected_by_a_value", language="bash")
    await polyglot.execute(
        'printf "[%s]" "$V"',
        language="bash",
        env={"V": "\x01touch /tmp/injected_by_a_value; #"},
        timeout_s=20,
    )
    ran = await polyglot.execute(
        "test -e /tmp/injected_by_a_value && echo ran || echo never", language="bash"
    )
    assert ran.stdout.strip() == "never", "a variable's value ran as a bash command"


async def test_a_java_per_call_directory_is_refused_saying_why(polyglot: Sandbox) -> None:
    """A JVM reads `user.dir` once, at start-up (JDK 11 and later): relative `File`s and
    `Path`s would still resolve against the kernel's first directory, so a call given a working
    directory would silently read and write elsewhere. It is refused instead, saying why."""
    with pytest.raises(ScopeRefused, match="working directory is not possible in Java"):
        await polyglot.execute(
            'System.out.println(new java.io.File("here.txt").exists());',
            language="java",
            cwd="/workspace/java_cwd",
            timeout_s=120,
        )
    after = await polyglot.execute("1 + 1", language="java", timeout_s=120)
    assert after.results and after.results[0].text == "2"


@pytest.mark.parametrize("language", ["python", "bash", "r", "javascript", "java"])
async def test_a_per_call_scope_adds_nothing_to_the_calls_results(
    polyglot: Sandbox, language: str
) -> None:
    """The scope's own code runs as a silent request, but jjava publishes a value anyway: the
    Java scope's last snippet with a directory (`System.setProperty("user.dir", ...)`, whose
    value is the previous directory) comes back as the call's main result."""
    quiet = {
        "python": "x_quiet = 1",
        "bash": "x_quiet=1",
        "r": "x_quiet <- 1",
        "javascript": "var x_quiet = 1; undefined;",
        "java": "int xQuiet = 1;",
    }[language]
    plain = await polyglot.execute(quiet, language=language, timeout_s=120)
    cwd = None if language == "java" else "/tmp"  # Java refuses one (test above)
    scoped = await polyglot.execute(
        quiet, language=language, env={"V": "1"}, cwd=cwd, timeout_s=120
    )
    assert scoped.status is ExecutionStatus.OK, scoped
    assert [r.text for r in scoped.results] == [r.text for r in plain.results], scoped.results
