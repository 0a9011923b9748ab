"""MCP's `code_interpreter` in other languages, reached with the `mcp` package's own client over
stdio: the description lists the languages, a Bash cell keeps its state, a language there is
not is an error result naming those there are."""

from __future__ import annotations

import sys

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests.clients.test_mcp import session_of, stdio_env, text_of

__all__ = ["stdio_env"]  # the fixture, shared with test_mcp.py


async def test_mcp_runs_bash_beside_python_and_refuses_an_unknown_language(
    stdio_env: dict[str, str],
) -> None:
    command = StdioServerParameters(
        command=sys.executable, args=["-m", "orchestrator", "mcp"], env=stdio_env
    )
    async with Client(command, mode="legacy") as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        code_tool = tools["code_interpreter"]
        assert "language" in code_tool.input_schema["properties"]
        assert code_tool.input_schema["required"] == ["code"]
        assert "set language to one of bash" in (code_tool.description or "")

        first = await client.call_tool("code_interpreter", {"code": "N=6", "language": "bash"})
        assert not first.is_error, text_of(first)
        second = await client.call_tool(
            "code_interpreter", {"code": "echo $((N * 7))", "language": "bash"}
        )
        assert "[stdout]\n42" in text_of(second) and " · bash · " in text_of(second)
        assert session_of(first) == session_of(second)  # the connection's one session
        python = await client.call_tool("code_interpreter", {"code": "'N' in globals()"})
        assert "[result]\nFalse" in text_of(python)  # each language has its own variables

        unknown = await client.call_tool("code_interpreter", {"code": "1", "language": "cobol"})
        assert unknown.is_error
        for name in ("'cobol'", "python", "bash", "Omit language"):
            assert name in text_of(unknown), text_of(unknown)
