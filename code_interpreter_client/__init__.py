"""The client side of code-interpreter-runtime: what an agent's process imports.

`Client`/`AsyncClient` speak the HTTP API; `CodeSession` is one lasting session behind a
framework's tool (remote, or embedded when the server extra is installed); `langchain` and
`openai_agents` adapt it. Installs without the server stack: `pip install code-interpreter-runtime`.
"""

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.http_client import APIError, AsyncClient, Client

__all__ = ["APIError", "AsyncClient", "Client", "CodeSession"]
