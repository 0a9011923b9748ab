"""The MCP server this service serves (its tools: code_interpreter and the workspace files)."""
