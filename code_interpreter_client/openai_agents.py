"""The code interpreter as an OpenAI Agents SDK tool: text as text, images as ToolOutputImage.

    from agents import Agent, Runner
    from code_interpreter_client.openai_agents import code_interpreter_tool

    agent = Agent(name="analyst", tools=[code_interpreter_tool()])

The tool is bound to one CodeSession (an embedded local sandbox unless given one), started with
the first call, so the model does not juggle session ids: state lasts as long as the tool.
"""

from __future__ import annotations

import base64
from typing import Any

from agents import FunctionTool, RunContextWrapper, ToolOutputImage, ToolOutputText

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.http_client import APIError
from code_interpreter_client.language_errors import language_refusal
from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.tool_arguments import TOOL_NAME, ToolCallError, parse_arguments
from code_interpreter_wire.tool_definitions import LIBRARIES, code_only_schema, description

ToolOutput = ToolOutputText | ToolOutputImage


def code_interpreter_tool(
    session: CodeSession | None = None,
    *,
    timeout_s: float = 300.0,
    name: str = TOOL_NAME,
    languages: list[str] | None = None,
) -> FunctionTool:
    """A FunctionTool running the model's code in `session` (by default a new embedded one),
    in any language it has: `languages`, else asked of the session (without starting it), are
    listed in the description and the `language` argument's schema.

    Close a session you pass when the agent is done (`await session.close()`); the default
    one is closed when the process exits.
    """
    bound = session if session is not None else CodeSession.for_process()
    offered = languages or bound.offered_languages()

    async def invoke(context: RunContextWrapper[Any], raw_arguments: str) -> list[ToolOutput]:
        try:
            arguments = parse_arguments(raw_arguments, bound_session=True)
        except ToolCallError as exc:  # told to the model, which can fix its call
            return [ToolOutputText(text=f"[error] {exc}")]
        try:
            execution = await bound.execute(
                arguments.code, timeout_s=timeout_s, language=arguments.language
            )
        except (SandboxError, APIError) as exc:  # a language there is not: the model's to fix
            refusal = language_refusal(exc)
            if refusal is None:
                raise
            return [ToolOutputText(text=f"[error] {refusal}")]
        rendered = bound.render(execution, arguments.language)
        outputs: list[ToolOutput] = [ToolOutputText(text=rendered.text)]
        for image in rendered.attached():
            data = base64.b64encode(image.data).decode()
            outputs.append(ToolOutputImage(image_url=f"data:{image.mime_type};base64,{data}"))
        return outputs

    tool = FunctionTool(
        name=name,
        description=description(
            timeout_s=timeout_s, libraries=LIBRARIES, bound_session=True, languages=offered
        ),
        params_json_schema=code_only_schema(offered),
        on_invoke_tool=invoke,
        strict_json_schema=True,
    )
    return tool
