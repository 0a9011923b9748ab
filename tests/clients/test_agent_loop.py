"""examples/agent_loop.py, run as a user runs it, against a scripted OpenAI-compatible server.

The server plays a model: it asks for two tool calls at once, checks that both answers came back
in the calls' order (then the image), asks for a third call that needs the first call's state,
and finally answers with a figure it read from a tool's output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from tests.orchestrator.service.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
LOAD = (
    "import pandas as pd\n"
    "sales = pd.read_csv('sales.csv')\n"
    "by = sales.pivot(index='month', columns='region', values='revenue')\n"
    "growth = (by.iloc[-1] / by.iloc[0] - 1).sort_values()\n"
    "print(f'fastest: {growth.index[-1]} {growth.iloc[-1]:.1%}')"
)
PLOT = (
    "import matplotlib.pyplot as plt\n"
    "import pandas as pd\n"
    "pd.read_csv('sales.csv').pivot(index='month', columns='region', values='revenue').plot()\n"
    "plt.show()"
)


def call(call_id: str, code: str) -> dict[str, Any]:
    arguments = json.dumps({"code": code})
    return {"id": call_id, "type": "function", "function": {"name": "code_interpreter",
            "arguments": arguments}}  # fmt: skip


def reply(message: dict[str, Any]) -> dict[str, Any]:
    reason = "tool_calls" if message.get("tool_calls") else "stop"
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class ScriptedModel:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        messages = body["messages"]
        turn = len(self.requests)
        if turn == 1:
            assert body["tools"][0]["function"]["name"] == "code_interpreter"
            calls = [call("call-load", LOAD), call("call-plot", PLOT)]
            return reply({"role": "assistant", "content": None, "tool_calls": calls})
        if turn == 2:
            calls = [call("call-state", "growth.round(3).to_dict()")]
            return reply({"role": "assistant", "content": None, "tool_calls": calls})
        tool_texts = [m["content"] for m in messages if m["role"] == "tool"]
        fastest = re.search(r"fastest: (\w+) ([\d.]+%)", tool_texts[0])
        assert fastest is not None, tool_texts
        return reply(
            {"role": "assistant", "content": f"{fastest[1]} grew fastest, by {fastest[2]}."}
        )


def run_example(base_url: str, *args: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "examples/agent_loop.py", "--base-url", base_url, *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.fixture
def model_server() -> Iterator[tuple[str, ScriptedModel]]:
    script = ScriptedModel()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return script.answer(body)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", script
    server.should_exit = True
    thread.join(timeout=10)


def test_agent_loop_runs_parallel_calls_and_answers(
    model_server: tuple[str, ScriptedModel], tmp_path: Path
) -> None:
    base_url, script = model_server
    done = run_example(
        base_url, "--model", "scripted", "--api-key", "test", "--output-dir", tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "=== answer\nSouth grew fastest, by 53.7%." in done.stdout

    # After the two parallel calls: both tool messages, in the calls' order, then the image.
    second = script.requests[1]["messages"]
    assistant = next(i for i, m in enumerate(second) if m.get("tool_calls"))
    tool_load, tool_plot, images = second[assistant + 1 : assistant + 4]
    assert (tool_load["role"], tool_load["tool_call_id"]) == ("tool", "call-load")
    assert (tool_plot["role"], tool_plot["tool_call_id"]) == ("tool", "call-plot")
    assert "fastest: South" in tool_load["content"]
    assert images["role"] == "user"
    assert images["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    # The third call used the first call's variables: one kernel throughout.
    third = script.requests[2]["messages"]
    assert "'South': 0.537" in third[-1]["content"]
    assert list(tmp_path.glob("figure-*.png"))


def test_a_model_endpoint_that_is_down_is_reported(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    done = run_example(f"http://127.0.0.1:{port}/v1", "--model", "m", "--output-dir", tmp_path)
    assert done.returncode == 1
    assert "error: the model endpoint failed: Connection error" in done.stderr
