"""Why a call of the Agents SDK's sandbox failed on our side: the way to the sandbox broke, or
the SDK asked for what a code-interpreter sandbox does not do."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from code_interpreter_client.http_client import APIError
from code_interpreter_wire.errors import SandboxError

# Failures of the way to the sandbox (not of the command run in it).
TRANSPORT_ERRORS = (SandboxError, APIError, httpx.HTTPError, ValidationError)


class ServiceOnly(ValueError):
    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs a running service (base_url=...): an embedded session lives and "
            "ends with this process, so there is nothing to pause or snapshot for a later one"
        )


class SingleUser(ValueError):
    def __init__(self) -> None:
        super().__init__(
            "a code-interpreter sandbox runs everything as its one unprivileged user (it has no "
            "other users and no root); run without `user` / `run_as`"
        )
