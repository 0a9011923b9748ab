"""E2B's synchronous `Sandbox`, unmodified, against our front: each behaviour on each backend."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server


def test_state_persists_and_the_execution_count_grows(sbx: Sandbox) -> None:
    first = sbx.run_code("x = 20\nprint('hi')")
    assert first.error is None and first.logs.stdout == ["hi\n"] and first.results == []
    second = sbx.run_code("x + 1")
    assert second.text == "21" and second.results[0].is_main_result
    assert second.execution_count == first.execution_count + 1  # type: ignore[operator]


def test_results_and_display_data(sbx: Sandbox) -> None:
    chart = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()"
    )
    assert chart.error is None
    png = base64.b64decode(chart.results[0].png)
    assert png.startswith(b"\x89PNG") and not chart.results[0].is_main_result
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert "<table" in frame.results[0].html and "a" in frame.results[0].text
    shown = sbx.run_code(
        "from IPython.display import HTML, Markdown, display\n"
        "display(HTML('<b>bold</b>'))\ndisplay(Markdown('# title'))\n{'k': 1}"
    )
    assert shown.results[0].html == "<b>bold</b>"
    assert shown.results[1].markdown == "# title"
    assert shown.text == "{'k': 1}"


def test_errors_come_back_with_name_value_and_traceback(sbx: Sandbox) -> None:
    failed = sbx.run_code("def f():\n    raise ValueError('bad input')\nf()")
    assert failed.error is not None
    assert failed.error.name == "ValueError" and failed.error.value == "bad input"
    assert "raise ValueError" in failed.error.traceback
    assert sbx.run_code("1 + 1").text == "2"  # the kernel goes on


def test_streaming_callbacks_see_outputs_as_they_happen(sbx: Sandbox) -> None:
    seen: list[tuple[str, float, object]] = []
    started = time.monotonic()
    execution = sbx.run_code(
        "import sys, time\nprint('one', flush=True)\ntime.sleep(1.5)\n"
        "print('err', file=sys.stderr, flush=True)\ndisplay(42)\nraise KeyError('k')",
        on_stdout=lambda m: seen.append(("stdout", time.monotonic() - started, m.line)),
        on_stderr=lambda m: seen.append(("stderr", time.monotonic() - started, m.line)),
        on_result=lambda r: seen.append(("result", time.monotonic() - started, r.text)),
        on_error=lambda e: seen.append(("error", time.monotonic() - started, e.name)),
    )
    assert [(kind, value) for kind, _, value in seen] == [
        ("stdout", "one\n"),
        ("stderr", "err\n"),
        ("result", "42"),
        ("error", "KeyError"),
    ]
    assert seen[1][1] - seen[0][1] > 1.0, "stdout was not streamed before the sleep ended"
    assert execution.logs.stderr == ["err\n"] and execution.error is not None


def test_the_sdk_timeout_interrupts_the_kernel(sbx: Sandbox) -> None:
    sbx.run_code("kept = 1")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(30)\nfinished = True", timeout=2)
    started = time.monotonic()
    after = sbx.run_code("'finished' in globals(), kept")
    assert after.text == "(False, 1)"  # interrupted, state kept
    assert time.monotonic() - started < 10, "the kernel was still busy with the old code"


def test_environment_variables(e2b_env: Server, template: str) -> None:
    sandbox = Sandbox.create(template=template, envs={"FOR_LIFE": "yes"})
    try:
        code = "import os\nos.environ.get('PER_CALL'), os.environ.get('FOR_LIFE')"
        assert sandbox.run_code(code, envs={"PER_CALL": "v"}).text == "('v', 'yes')"
        assert sandbox.run_code(code).text == "(None, 'yes')"
    finally:
        sandbox.kill()


def test_files_in_and_out(sbx: Sandbox) -> None:
    info = sbx.files.write("data/in.csv", "a,b\n1,2\n")
    assert info.path == "/workspace/data/in.csv" and info.name == "in.csv"
    sbx.files.write("/workspace/raw.bin", b"\x00\xff")
    code = (
        "import pandas as pd\ndf = pd.read_csv('data/in.csv')\n"
        "df.to_csv('out.csv', index=False)\nopen('raw.bin', 'rb').read()"
    )
    assert sbx.run_code(code).text == "b'\\x00\\xff'"
    assert sbx.files.read("out.csv") == "a,b\n1,2\n"
    assert bytes(sbx.files.read("raw.bin", format="bytes")) == b"\x00\xff"
    names = {(e.name, e.type.value if e.type else None) for e in sbx.files.list("/workspace")}
    assert {("data", "dir"), ("out.csv", "file"), ("raw.bin", "file")} <= names
    assert [e.path for e in sbx.files.list("data")] == ["/workspace/data/in.csv"]
    assert sbx.files.exists("out.csv") and not sbx.files.exists("nope.txt")
    many = sbx.files.write_files(
        [{"path": "m/1.txt", "data": "1"}, {"path": "m/2.txt", "data": b"2"}]
    )
    assert [w.path for w in many] == ["/workspace/m/1.txt", "/workspace/m/2.txt"]
    sbx.files.write("zipped.txt", "z" * 10_000, gzip=True)  # octet-stream, gzip-encoded
    assert sbx.run_code("len(open('zipped.txt').read()), open('m/2.txt').read()").text == (
        "(10000, '2')"
    )
    assert sbx.files.get_info("data/in.csv").size == 8
    assert sbx.files.make_dir("made/deeper") is True
    assert sbx.files.make_dir("made/deeper") is False
    assert sbx.run_code("import os; os.path.isdir('made/deeper')").text == "True"
    sbx.files.remove("out.csv")
    assert not sbx.files.exists("out.csv")
    assert sbx.run_code("import os; os.path.exists('out.csv')").text == "False"
    with pytest.raises(NotFoundException):
        sbx.files.read("out.csv")
    sbx.files.write("/home/user/x.txt", "x")  # E2B's home is the workspace
    assert sbx.files.read("x.txt") == "x"
    assert "passwd" in [e.name for e in sbx.files.list("/etc")]  # the sandbox's own /etc


def test_contexts(sbx: Sandbox) -> None:
    sbx.run_code("where = 'default'")
    context = sbx.create_code_context()
    assert context.language == "python" and context.cwd == "/home/user"  # E2B's home
    assert sbx.run_code("where = 'mine'; where", context=context).text == "mine"
    assert sbx.run_code("where").text == "default"  # each context has its own variables
    assert [c.id for c in sbx.list_code_contexts()][-1] == context.id  # after the defaults
    sbx.restart_code_context(context)
    assert sbx.run_code("'where' in globals()", context=context).text == "False"
    assert sbx.run_code("where").text == "default"
    sbx.remove_code_context(context)
    assert context.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=context)
    sbx.restart_code_context("default")
    assert sbx.run_code("'where' in globals()").text == "False"
    with pytest.raises(SandboxException, match="unknown language 'cobol'"):
        sbx.run_code("1", language="cobol")


def test_get_list_set_timeout_connect_and_kill(e2b_env: Server, template: str) -> None:
    sandbox = Sandbox.create(template=template, timeout=600, metadata={"job": "t1"})
    try:
        sandbox.run_code("state = 'kept'")
        info = sandbox.get_info()
        assert info.sandbox_id == sandbox.sandbox_id and info.template_id == template
        assert info.metadata == {"job": "t1"} and info.state.value == "running"
        assert 550 < (info.end_at - info.started_at).total_seconds() <= 601
        listed = Sandbox.list().next_items()
        assert sandbox.sandbox_id in [s.sandbox_id for s in listed]
        from e2b import SandboxQuery

        other = Sandbox.list(query=SandboxQuery(metadata={"job": "nope"})).next_items()
        assert sandbox.sandbox_id not in [s.sandbox_id for s in other]
        sandbox.set_timeout(60)
        remaining = (sandbox.get_info().end_at - info.started_at).total_seconds()
        assert remaining < 120
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.run_code("state").text == "kept"
        assert sandbox.is_running()
    finally:
        assert sandbox.kill() is True
    assert not sandbox.is_running()
    assert sandbox.kill() is False
    assert sandbox.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with pytest.raises(TimeoutException):  # E2B's answer for a sandbox that is gone
        sandbox.run_code("1")


def test_the_timeout_kills_the_sandbox(e2b_env: Server) -> None:
    sandbox = Sandbox.create(timeout=2)
    assert sandbox.run_code("1").text == "1"
    deadline = time.monotonic() + 15
    while sandbox.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not sandbox.is_running()
    with pytest.raises(NotFoundException):
        sandbox.get_info()


def test_another_key_cannot_see_or_touch_the_sandbox(sbx: Sandbox, e2b_env: Server) -> None:
    sid = sbx.sandbox_id
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid, api_key=KEY_B)
    assert Sandbox.kill(sid, api_key=KEY_B) is False
    assert sid not in [s.sandbox_id for s in Sandbox.list(api_key=KEY_B).next_items()]
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, api_key=KEY_B)
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-key")
    # The data plane wants this sandbox's own token: another's, or none, finds nothing.
    theirs = Sandbox.create(api_key=KEY_B)
    try:
        for token in (theirs._envd_access_token, "", None):
            headers = {"E2b-Sandbox-Id": sid, "X-Access-Token": token or ""}
            reply = httpx.post(f"{e2b_env.url}/execute", json={"code": "1"}, headers=headers)
            assert reply.status_code == 502 and "was not found" in reply.json()["message"]
            listing = httpx.get(f"{e2b_env.url}/contexts", headers=headers)
            assert listing.status_code == 502
            assert listing.headers["Should-Retry"] == "false"  # gone: no use waiting
    finally:
        theirs.kill()
    assert sbx.run_code("'still here'").text == "still here"
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": KEY_A}) as api:
        assert api.get(f"/sandboxes/{sid}").status_code == 200


def test_what_is_not_supported_says_why(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match="not supported by this server"):
        sbx.get_metrics()  # pausing is supported (test_sdk_pause_snapshots.py); metrics are not
    with pytest.raises(SandboxException, match="no root"):  # commands work; root does not
        sbx.commands.run("echo hi", user="root")
    with pytest.raises(SandboxException, match="template 'nope' not found"):
        Sandbox.create(template="nope")


def test_the_key_is_required(e2b_env: Server) -> None:
    reply = httpx.post(f"{e2b_env.url}/v2/sandboxes", json={"templateID": "base"})
    assert reply.status_code == 401 and reply.json()["code"] == 401
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": KEY_A}) as api:
        assert api.get("/sandboxes/s-nothing").json() == {
            "code": 404,
            "message": "no session s-nothing",
        }
    assert httpx.get(f"{e2b_env.url}/health").status_code == 200


def test_the_front_can_be_turned_off() -> None:
    from fastapi.testclient import TestClient

    from orchestrator.app import create_app
    from orchestrator.config import Settings

    for enabled, status in ((False, 404), (True, 401)):
        app = create_app(Settings(api_keys=["k"], e2b_compat=enabled))
        client = TestClient(app)  # no lifespan: no sandbox is started
        assert client.post("/v2/sandboxes", json={"templateID": "base"}).status_code == status


def test_the_docs_example(e2b_env: Server) -> None:
    with Sandbox.create() as sbx:
        sbx.files.write("sales.csv", "month,revenue\n1,10\n2,12\n")
        printed: list[str] = []
        execution = sbx.run_code(
            "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(len(df))\n"
            "int(df.revenue.sum())",
            on_stdout=lambda m: printed.append(m.line),
        )
        assert execution.text == "22" and printed == ["2\n"]
        sbx.files.write("chunks.txt", iter([b"a" * 70_000, b"b"]))  # a streamed upload
        assert sbx.run_code("len(open('chunks.txt').read())").text == "70001"
    assert not sbx.is_running()
