"""E2B's SDK, unmodified, running every language against our front: `run_code(language=...)`,
contexts of a language, the sandbox's and the call's `envs` in each kernel, E2B's `/home/user`,
a sandbox killed under a running request, and `secure=True` sandboxes; sync and async.

The sandboxes here use each backend's image with every language (the local backend: what the
host has, which on the machines this runs on is every language; Docker: the full image)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Execution, Sandbox

from sandbox.image_labels import FULL_IMAGE, KERNEL_IMAGE
from tests.e2b_sdk_fixtures import point_sdk_at, stop_cleanly
from tests.orchestrator.service.conftest import Server, make_server, service_backends

EVERY_LANGUAGE = ["python", "bash", "javascript", "typescript", "r", "java"]
HOME = "/home/user"
KILLED = "killed while the request was in progress"


def out(execution: Execution) -> str:
    """Everything the code printed (bash's output arrives a line at a time)."""
    return "".join(execution.logs.stdout)


def shown(execution: Execution) -> str | None:
    """The text of the first result: R's values come as display data, not a main result."""
    assert execution.error is None, execution.error
    return execution.results[0].text if execution.results else None


@pytest.fixture(scope="module")
def languages_server() -> Iterator[Server]:
    """A server whose Docker sessions may use the full image (every language)."""
    server = make_server(docker_images=f"{KERNEL_IMAGE},{FULL_IMAGE}", reap_interval_s=1)
    server.start()
    yield server
    stop_cleanly(server)


@pytest.fixture(params=service_backends())
def every_language_template(request: pytest.FixtureRequest) -> str:
    """The E2B template that gives a sandbox every language on each backend."""
    return FULL_IMAGE if request.param == "docker" else str(request.param)


@pytest.fixture
def lang_env(monkeypatch: pytest.MonkeyPatch, languages_server: Server) -> Server:
    point_sdk_at(monkeypatch, languages_server.url)
    return languages_server


@pytest.fixture
def polyglot(lang_env: Server, every_language_template: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(template=every_language_template, envs={"FROM_SANDBOX": "sbx"})
    yield sandbox
    sandbox.kill()


@pytest.fixture
async def apolyglot(lang_env: Server, every_language_template: str) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(
        template=every_language_template, envs={"FROM_SANDBOX": "sbx"}
    )
    yield sandbox
    await sandbox.kill()


def test_run_code_reaches_each_languages_kernel_with_its_state(polyglot: Sandbox) -> None:
    polyglot.files.write("shared.txt", "from the workspace")
    assert out(polyglot.run_code("n=5; echo start", language="bash")) == "start\n"
    shared = polyglot.run_code("echo $((n + 1)); cat shared.txt", language="bash")
    assert out(shared).rstrip("\n") == "6\nfrom the workspace"
    assert polyglot.run_code("x <- 20", language="r").error is None
    assert shown(polyglot.run_code("x + 1", language="r")) == "[1] 21"
    assert polyglot.run_code("let a = 2;", language="js").error is None
    assert polyglot.run_code("a * 3", language="javascript").text == "6"
    assert polyglot.run_code("const t: number = 4; t * 2", language="ts").text == "8"
    assert polyglot.run_code("int j = 3;", language="java").error is None
    assert polyglot.run_code("j * 2", language="java").text == "6"
    # As E2B's Java kernel sends it: `println`'s line, then its newline.
    printed = polyglot.run_code('System.out.println("Hello, World!")', language="java")
    assert printed.logs.stdout == ["Hello, World!", "\n"]
    failed = polyglot.run_code("stop('bad input')", language="r")
    assert failed.error is not None and "bad input" in failed.error.value
    assert polyglot.run_code("n = 'python'; n").text == "python"  # each kernel its own names


def test_an_unknown_language_is_refused_naming_the_languages(polyglot: Sandbox) -> None:
    with pytest.raises(SandboxException, match="unknown language 'cobol'") as refused:
        polyglot.run_code("1", language="cobol")
    assert "python, bash, javascript, typescript, r, java" in str(refused.value)
    with pytest.raises(SandboxException, match="unknown language 'cobol'"):
        polyglot.create_code_context(language="cobol")


def test_a_language_the_image_lacks_is_refused_naming_those_it_has(lang_env: Server) -> None:
    if "docker" not in service_backends():
        pytest.skip("only the Docker backend has an image without every language")
    sandbox = Sandbox.create(template=KERNEL_IMAGE)
    try:
        with pytest.raises(SandboxException, match="'r' is not installed") as refused:
            sandbox.run_code("1", language="r")
        assert "it has: python, bash" in str(refused.value)
        languages = [c.language for c in sandbox.list_code_contexts()]
        assert languages == ["python", "bash"]
    finally:
        sandbox.kill()


def test_contexts_of_each_language(polyglot: Sandbox) -> None:
    listed = polyglot.list_code_contexts()
    assert [c.language for c in listed] == EVERY_LANGUAGE  # a default context per language
    assert {c.cwd for c in listed} == {HOME}
    assert len({c.id for c in listed}) == len(listed)
    default_r = next(c for c in listed if c.language == "r")
    polyglot.run_code("who <- 'default'", language="r")
    assert shown(polyglot.run_code("who", context=default_r)) == '[1] "default"'

    mine = polyglot.create_code_context(language="r", cwd="/tmp")
    assert mine.language == "r" and mine.cwd == "/tmp"
    assert shown(polyglot.run_code("who <- 'mine'; getwd()", context=mine)) == '[1] "/tmp"'
    assert shown(polyglot.run_code("who", language="r")) == '[1] "default"'
    js = polyglot.create_code_context(language="js")
    assert js.language == "javascript" and js.cwd == HOME
    assert polyglot.run_code("typeof Deno.version", context=js).text == "object"
    default_bash = next(c for c in listed if c.language == "bash")
    assert polyglot.run_code("echo ${BASH_VERSION:+bash}", context=default_bash).logs.stdout == [
        "bash\n"
    ]
    relisted = polyglot.list_code_contexts()
    assert [c.id for c in relisted] == [c.id for c in listed] + [mine.id, js.id]
    assert [c.language for c in relisted][-2:] == ["r", "javascript"]

    polyglot.run_code("kept = 1")
    polyglot.restart_code_context(default_r)  # R's kernel only
    assert shown(polyglot.run_code("exists('who')", language="r")) == "[1] FALSE"
    assert polyglot.run_code("kept").text == "1"
    polyglot.restart_code_context(mine)
    assert shown(polyglot.run_code("exists('who')", context=mine)) == "[1] FALSE"
    polyglot.remove_code_context(mine)
    with pytest.raises(NotFoundException):
        polyglot.run_code("1", context=mine)


def test_the_default_context_works_in_e2b_home(polyglot: Sandbox) -> None:
    polyglot.files.write("x.txt", "written by files")
    polyglot.files.write(f"{HOME}/y.txt", "written to the home")
    code = (
        "import os; open('x.txt').read(), open('y.txt').read(), os.path.samefile('.', '/home/user')"
    )
    assert polyglot.run_code(code).text == "('written by files', 'written to the home', True)"
    both = polyglot.run_code("cat x.txt; echo; cat /workspace/y.txt", language="bash")
    assert out(both).rstrip("\n") == "written by files\nwritten to the home"
    assert shown(polyglot.run_code("readLines('y.txt', warn=FALSE)", language="r")) == (
        '[1] "written to the home"'
    )
    assert polyglot.run_code("Deno.readTextFileSync('x.txt')", language="js").text == (
        "written by files"
    )
    # E2B's kernels run in the home, and say so.
    assert polyglot.run_code("import os; os.getcwd()").text == HOME
    # A shell the code starts names it so too (it trusts $PWD, which was /workspace's name).
    assert "".join(polyglot.run_code("!pwd").logs.stdout).strip() == HOME
    assert out(polyglot.run_code("pwd", language="bash")).strip() == HOME
    assert shown(polyglot.run_code("getwd()", language="r")) == f'[1] "{HOME}"'


def test_sandbox_and_call_envs_reach_every_kernel(polyglot: Sandbox) -> None:
    per_call = {"FROM_CALL": "call"}
    echo = "echo $FROM_SANDBOX-${FROM_CALL:-unset}"
    assert polyglot.run_code(echo, language="bash", envs=per_call).logs.stdout == ["sbx-call\n"]
    assert polyglot.run_code(echo, language="bash").logs.stdout == ["sbx-unset\n"]
    r_code = "paste(Sys.getenv('FROM_SANDBOX'), Sys.getenv('FROM_CALL', 'unset'))"
    assert shown(polyglot.run_code(r_code, language="r", envs=per_call)) == '[1] "sbx call"'
    assert shown(polyglot.run_code(r_code, language="r")) == '[1] "sbx unset"'
    js_code = "`${Deno.env.get('FROM_SANDBOX')} ${Deno.env.get('FROM_CALL') ?? 'unset'}`"
    assert polyglot.run_code(js_code, language="js", envs=per_call).text == "sbx call"
    assert polyglot.run_code(js_code, language="js").text == "sbx unset"
    java_code = 'System.getenv("FROM_SANDBOX") + " " + System.getenv("FROM_CALL")'
    assert polyglot.run_code(java_code, language="java", envs=per_call).text == "sbx call"
    assert polyglot.run_code(java_code, language="java").text == "sbx null"
    # E2B's Java kernel has them as system properties too: the sandbox's from the start, a
    # call's for that call, and a call's that overrides the sandbox's only for that call.
    props = 'System.getProperty("FROM_SANDBOX") + " " + System.getProperty("FROM_CALL", "unset")'
    assert polyglot.run_code(props, language="java", envs=per_call).text == "sbx call"
    assert polyglot.run_code(props, language="java").text == "sbx unset"
    overridden = polyglot.run_code(props, language="java", envs={"FROM_SANDBOX": "mine"})
    assert overridden.text == "mine unset"
    assert polyglot.run_code(props, language="java").text == "sbx unset"
    py_code = "import os; os.environ['FROM_SANDBOX'], os.environ.get('FROM_CALL')"
    assert polyglot.run_code(py_code, envs=per_call).text == "('sbx', 'call')"
    assert polyglot.run_code(py_code).text == "('sbx', None)"


async def test_async_languages_contexts_and_envs(apolyglot: AsyncSandbox) -> None:
    await apolyglot.files.write("a.txt", "async")
    ran = await apolyglot.run_code('cat a.txt; echo " $FROM_SANDBOX"', language="bash")
    assert ran.logs.stdout == ["async sbx\n"]
    assert shown(await apolyglot.run_code("1 + 1", language="r")) == "[1] 2"
    context = await apolyglot.create_code_context(language="typescript")
    assert context.language == "typescript" and context.cwd == HOME
    ts = "const v: string = Deno.env.get('FROM_CALL') ?? 'unset'; v"
    assert (await apolyglot.run_code(ts, context=context, envs={"FROM_CALL": "c"})).text == "c"
    listed = await apolyglot.list_code_contexts()
    assert [c.language for c in listed] == [*EVERY_LANGUAGE, "typescript"]
    await apolyglot.restart_code_context(listed[1])  # bash's default context
    with pytest.raises(SandboxException, match="unknown language"):
        await apolyglot.run_code("1", language="cobol")


# ---------------------------------------------------------------------------------------------
# A sandbox killed while a request runs


def test_a_sandbox_killed_under_a_running_execution(lang_env: Server, template: str) -> None:
    sandbox = Sandbox.create(template=template)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            sandbox.run_code("import time; print('started', flush=True); time.sleep(120)")
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(3)
    assert Sandbox.kill(sandbox.sandbox_id) is True
    runner.join(60)
    assert not runner.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutException), outcome
    assert KILLED in str(outcome[0])


async def test_async_a_sandbox_killed_under_a_running_execution(
    lang_env: Server, template: str
) -> None:
    sandbox = await AsyncSandbox.create(template=template)
    running = asyncio.ensure_future(sandbox.run_code("sleep 120", language="bash"))
    await asyncio.sleep(3)
    assert await AsyncSandbox.kill(sandbox.sandbox_id) is True
    with pytest.raises(TimeoutException, match=KILLED):
        await asyncio.wait_for(running, 60)


# ---------------------------------------------------------------------------------------------
# secure=True


def test_a_secure_sandbox_issues_and_checks_its_token(lang_env: Server, template: str) -> None:
    sandbox = Sandbox.create(template=template, secure=True)
    try:
        assert sandbox._envd_access_token and sandbox.traffic_access_token
        context = sandbox.create_code_context(language="bash")
        assert sandbox.run_code("echo secured", context=context).logs.stdout == ["secured\n"]
        assert context.id in [c.id for c in sandbox.list_code_contexts()]
        sandbox.restart_code_context(context)
        headers = {"E2b-Sandbox-Id": sandbox.sandbox_id}
        for token in ({}, {"E2B-Traffic-Access-Token": "wrong"}, {"X-Access-Token": "wrong"}):
            with httpx.Client(base_url=lang_env.url, headers={**headers, **token}) as raw:
                assert raw.post("/contexts", json={}).status_code == 502
                assert raw.get("/contexts").status_code == 502
                assert raw.post("/execute", json={"code": "1"}).status_code == 502
                assert raw.post(f"/contexts/{context.id}/restart").status_code == 502
        sandbox.remove_code_context(context)
    finally:
        sandbox.kill()


async def test_async_a_secure_sandbox_runs_contexts(lang_env: Server, template: str) -> None:
    sandbox = await AsyncSandbox.create(template=template, secure=True)
    try:
        context = await sandbox.create_code_context()
        assert (await sandbox.run_code("'ok'", context=context)).text == "ok"
        await sandbox.remove_code_context(context.id)
    finally:
        await sandbox.kill()


@pytest.fixture(params=service_backends())
def template(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
