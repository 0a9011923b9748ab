"""`language` through the Python client and the adapters built on it: CodeSession (embedded and
remote), the LangChain tool and the OpenAI Agents SDK tool, each running a Bash cell beside
Python's, listing the languages without starting a sandbox, and telling the model which
languages there are when it asks for one there is not."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from agents import Agent, Runner

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.http_client import APIError
from code_interpreter_client.langchain import CodeInterpreterTool
from code_interpreter_client.openai_agents import code_interpreter_tool
from code_interpreter_wire.errors import UnknownLanguage
from tests.clients.test_openai_agents import OFFLINE, ScriptedModel
from tests.orchestrator.service.conftest import KEY_A, Server, make_server


def call(code: str, language: str | None = None) -> dict[str, object]:
    args: dict[str, object] = {"code": code}
    if language is not None:
        args["language"] = language
    return {"type": "tool_call", "id": "call-1", "name": "code_interpreter", "args": args}


async def test_an_embedded_session_lists_its_languages_before_it_starts(
    code_session: CodeSession,
) -> None:
    languages = await code_session.languages()
    assert code_session.session_id is None  # asked of the backend: no sandbox started
    assert languages[0] == "python" and "bash" in languages
    first = await code_session.execute("X=5", language="bash")
    assert first.ok and getattr(first, "language", None) == "bash"
    assert (await code_session.execute("echo $((X * 2))", language="bash")).stdout == "10\n"
    assert code_session.execute_sync("21 * 2").text == "42"  # Python's kernel, its own state
    with pytest.raises(UnknownLanguage, match="python, bash"):
        await code_session.execute("1", language="cobol")


async def test_the_langchain_tool_takes_a_language(code_session: CodeSession) -> None:
    tool = CodeInterpreterTool(session=code_session)
    offered = await code_session.languages()
    assert "language" in tool.tool_call_schema.model_json_schema()["properties"]
    others = [name for name in offered if name != "python"]
    assert f"set language to one of {', '.join(others)}" in tool.description

    message = await tool.ainvoke(call("echo hello from $0", "bash"))
    assert "[stdout]\nhello from" in message.content and " · bash · " in message.content
    refused = tool.invoke(call("1", "cobol"))
    assert refused.status == "error"
    assert "'cobol'" in refused.content and "python, bash" in refused.content
    assert "the sandbox failed" not in refused.content  # the model's to fix, not a failure


async def test_the_agents_sdk_tool_has_a_strict_language_argument(
    code_session: CodeSession,
) -> None:
    tool = code_interpreter_tool(code_session)
    schema = tool.params_json_schema
    language = schema["properties"]["language"]
    assert set(schema["required"]) == {"code", "language"}  # strict: optional means nullable
    assert language["enum"][-1] is None and "bash" in language["enum"]
    model = ScriptedModel(
        [
            {"code": "TOTAL=40", "language": "bash"},
            {"code": "echo $((TOTAL + 2))", "language": "bash"},
            {"code": "1 + 1", "language": None},
            {"code": "1", "language": "cobol"},
        ]
    )
    agent = Agent(name="analyst", model=model, tools=[tool])
    result = await Runner.run(agent, "Count in bash.", run_config=OFFLINE)
    assert result.final_output == "done"
    _, bash, python, unknown = (json.dumps(output) for output in model.tool_outputs())
    assert "[stdout]\\n42" in bash and "[result]\\n2" in python
    assert "'cobol'" in unknown and "python, bash" in unknown


@pytest.fixture(scope="module")
def service() -> Iterator[Server]:
    srv = make_server().start()
    yield srv
    srv.stop()
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


async def test_a_remote_session_runs_bash_and_refuses_an_unknown_language(
    service: Server,
) -> None:
    async with CodeSession.remote(service.url, KEY_A) as remote:
        offered = await remote.languages()  # GET /v1/languages: nothing started
        assert remote.session_id is None and "bash" in offered
        await remote.execute("GREETING=hi", language="bash")
        streamed: list[str] = []

        async def seen(event: object) -> None:
            streamed.append(getattr(event, "text", ""))

        done = await remote.execute('echo "$GREETING there"', language="bash", on_event=seen)
        assert done.stdout == "hi there\n" and "".join(streamed) == "hi there\n"
        assert await remote.languages() == offered  # now the session's own
        with pytest.raises(APIError) as refused:
            await remote.execute("1", language="cobol")
        assert refused.value.status == 400 and refused.value.kind == "UnknownLanguage"
        assert "python, bash" in refused.value.message
