"""A small MCP server for the tests, built with the MCP SDK: stdio by default, or
streamable HTTP on 127.0.0.1 with `--http PORT`."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@server.tool(name="word-count")
def word_count(text: str) -> dict[str, int]:
    """Count the words of a text."""
    return {"words": len(text.split())}


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
def fail(message: str) -> str:
    """Always fails with the message."""
    raise ValueError(message)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
