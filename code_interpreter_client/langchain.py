"""The code interpreter as a LangChain tool: text for the model, the whole Execution as artifact.

    from code_interpreter_client.langchain import CodeInterpreterTool

    tool = CodeInterpreterTool()          # an embedded local sandbox, started on first use
    message = tool.invoke({"type": "tool_call", "id": "call-1", "name": "code_interpreter",
                           "args": {"code": "1 + 1"}})
    tool.invoke({"code": "summary(cars)", "language": "r"})   # any language the sandbox has
    message.content    # what the model reads
    message.artifact   # code_interpreter_wire.results.Execution: results, images, stdout, error...

`response_format="content_and_artifact"` keeps images and full outputs out of the model's
context while the application still gets them. Sync and async calls share one session.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from langchain_core.tools import BaseTool, ToolException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.http_client import APIError
from code_interpreter_client.language_errors import language_refusal
from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import Execution
from code_interpreter_wire.tool_arguments import TOOL_NAME, explain_invalid
from code_interpreter_wire.tool_definitions import LIBRARIES, description

DEFAULT_TIMEOUT_S = 300.0


class CodeInterpreterInput(BaseModel):
    code: str = Field(min_length=1, description="The code to run.")
    language: str | None = Field(
        None,
        max_length=100,
        description="The language of code (e.g. python, r, bash, javascript); Python if omitted.",
    )


def _explain(exc: Any) -> str:
    return f"[error] {explain_invalid(exc)}" if isinstance(exc, ValidationError) else str(exc)


class CodeInterpreterTool(BaseTool):
    """Runs the model's code in one stateful sandbox session (by default an embedded one)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str = TOOL_NAME
    description: str = description(
        timeout_s=DEFAULT_TIMEOUT_S, libraries=LIBRARIES, bound_session=True, languages=[PYTHON]
    )
    args_schema: type[BaseModel] = CodeInterpreterInput
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"
    # A malformed call or a sandbox that cannot start is told to the model, not raised.
    handle_validation_error: Any = _explain
    handle_tool_error: Any = True
    session: CodeSession = Field(default_factory=CodeSession.for_process, exclude=True)
    timeout_s: float = DEFAULT_TIMEOUT_S
    # The languages the description lists; None: asked of the session (without starting it).
    languages: list[str] | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _describe_languages(self) -> Self:
        """Unless a description was given, it lists the languages this session has."""
        if "description" not in self.model_fields_set:
            languages = self.languages or self.session.offered_languages()
            self.languages = languages
            self.description = description(
                timeout_s=self.timeout_s,
                libraries=LIBRARIES,
                bound_session=True,
                languages=languages,
            )
        return self

    def _run(self, code: str, language: str | None = None, **_: Any) -> tuple[str, Execution]:
        try:
            execution = self.session.execute_sync(code, timeout_s=self.timeout_s, language=language)
        except (SandboxError, APIError) as exc:
            raise ToolException(f"[error] {_failure(exc)}") from exc
        return self.session.render(execution, language).text, execution

    async def _arun(
        self, code: str, language: str | None = None, **_: Any
    ) -> tuple[str, Execution]:
        try:
            execution = await self.session.execute(
                code, timeout_s=self.timeout_s, language=language
            )
        except (SandboxError, APIError) as exc:
            raise ToolException(f"[error] {_failure(exc)}") from exc
        return self.session.render(execution, language).text, execution


def _failure(exc: SandboxError | APIError) -> str:
    """A language there is not is the model's to fix; anything else is the sandbox's."""
    return language_refusal(exc) or f"the sandbox failed: {exc}"
