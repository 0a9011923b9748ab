"""The OpenAI Agents SDK tool, driven by the SDK's own Runner and a scripted model (no network)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, Model, ModelResponse, ModelSettings, RunConfig, Runner, Usage
from agents.items import TResponseInputItem, TResponseStreamEvent
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from PIL import Image

from code_interpreter_client.code_session import CodeSession
from code_interpreter_client.openai_agents import code_interpreter_tool

OFFLINE = RunConfig(tracing_disabled=True)  # traces would be sent to OpenAI
PLOT = (
    "import matplotlib.pyplot as plt\n"
    "values = [3, 1, 2]\n"
    "plt.plot(values)\n"
    "plt.show()\n"
    "print('sum', sum(values))"
)


class ScriptedModel(Model):
    """Plays back tool calls, then answers; keeps every input it was given."""

    def __init__(self, calls: list[dict[str, Any] | str]) -> None:
        self.calls = calls
        self.inputs: list[list[Any]] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        **_: Any,
    ) -> ModelResponse:
        self.inputs.append(list(input) if isinstance(input, list) else [input])
        turn = len(self.inputs)
        if turn <= len(self.calls):
            arguments = self.calls[turn - 1]
            raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
            output: list[Any] = [
                ResponseFunctionToolCall(
                    type="function_call",
                    id=f"fc-{turn}",
                    call_id=f"call-{turn}",
                    name="code_interpreter",
                    arguments=raw,
                    status="completed",
                )
            ]
        else:
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            output = [
                ResponseOutputMessage(
                    type="message", id="msg", role="assistant", status="completed", content=[text]
                )
            ]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the tests run the agent without streaming")

    def tool_outputs(self) -> list[Any]:
        """What the model was shown of each tool call, in order."""
        last = self.inputs[-1]
        return [
            item["output"]
            for item in last
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        ]


async def test_runner_calls_the_tool_and_the_model_sees_text_and_images(
    code_session: CodeSession,
) -> None:
    model = ScriptedModel([{"code": PLOT}, {"code": "values.append(4)\nsum(values)"}])
    agent = Agent(name="analyst", model=model, tools=[code_interpreter_tool(code_session)])

    result = await Runner.run(agent, "Plot the values and sum them.", run_config=OFFLINE)

    assert result.final_output == "done"
    first, second = model.tool_outputs()
    texts = [part["text"] for part in first if part["type"] == "input_text"]
    images = [part["image_url"] for part in first if part["type"] == "input_image"]
    assert "sum 6" in texts[0] and "[images] 1: image/png" in texts[0]
    assert len(images) == 1 and images[0].startswith("data:image/png;base64,")
    png = Image.open(io.BytesIO(base64.b64decode(images[0].split(",", 1)[1])))
    assert png.size[0] > 100
    # The same kernel: the second call sees the first call's variable.
    second_text = "".join(p["text"] for p in second if p["type"] == "input_text")
    assert "[result]\n10" in second_text


async def test_a_malformed_call_is_answered_with_what_to_fix(code_session: CodeSession) -> None:
    model = ScriptedModel(['{"cod": "1 + 1"}', '{"code": "print(1', '{"code": "print(1"}'])
    agent = Agent(name="analyst", model=model, tools=[code_interpreter_tool(code_session)])

    result = await Runner.run(agent, "Add.", run_config=OFFLINE)

    assert result.final_output == "done"
    missing, not_json, broken = model.tool_outputs()
    assert "'code' is missing" in json.dumps(missing)
    assert "not valid JSON" in json.dumps(not_json)
    # Valid JSON but broken Python: the kernel's own error comes back, the session lives on.
    assert "SyntaxError" in json.dumps(broken)
    assert (await code_session.execute("1 + 1")).text == "2"


def test_the_tool_definition_needs_no_session_id() -> None:
    tool = code_interpreter_tool(CodeSession.embedded())
    assert tool.name == "code_interpreter"
    assert tool.params_json_schema["required"] == ["code", "language"]  # strict: all of them
    assert "session_id" not in tool.params_json_schema["properties"]
    assert "session_id" not in tool.description and "persists" in tool.description
