"""What crosses the wire between the client and the service, in one place both sides import.

The result and output models, the sandbox spec and network policy, process requests and results,
language names, the HTTP API's bodies, the typed errors, the model tool's definitions, arguments
and output, and the loop the client runs on. It imports nothing of this project's other
packages (`sandbox`, `orchestrator`, `code_interpreter_client`), only pydantic and the standard
library, so a client-only install carries it whole.
"""
