"""The code_interpreter tool: definitions, invocation in each API's shape, malformed calls."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
from PIL import Image

PLOT = "import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()\nprint('drawn')"


def invoke(api: httpx.Client, arguments: object, fmt: str = "openai_chat", **extra: object) -> dict:  # type: ignore[type-arg]
    r = api.post(
        "/v1/tools/code_interpreter/invoke",
        json={"arguments": arguments, "format": fmt, "call_id": "call-1", **extra},
    )
    assert r.status_code == 200, r.text
    result: dict = r.json()  # type: ignore[type-arg]
    return result


def test_definitions_in_every_format(api: httpx.Client) -> None:
    defs = api.get("/v1/tools/code_interpreter").json()
    schema = defs["json_schema"]
    assert schema["required"] == ["code"]
    assert set(schema["properties"]) == {"code", "language", "session_id"}
    chat = defs["openai_chat"]
    assert chat["type"] == "function" and chat["function"]["name"] == "code_interpreter"
    assert chat["function"]["parameters"] == schema
    responses = defs["openai_responses"]
    assert responses["type"] == "function" and responses["name"] == "code_interpreter"
    assert defs["anthropic"]["input_schema"] == schema
    assert defs["mcp"]["inputSchema"] == schema
    text = chat["function"]["description"]
    for fact in ("pandas", "session_id", "/workspace", "no network", "persist"):
        assert fact.lower() in text.lower(), fact
    one = api.get("/v1/tools/code_interpreter", params={"format": "anthropic"}).json()
    assert one == defs["anthropic"]


def test_invoke_creates_a_session_and_keeps_state(api: httpx.Client) -> None:
    first = invoke(api, json.dumps({"code": "total = 40\nprint('set')"}))
    sid = first["session_id"]
    assert sid and first["status"] == "ok"
    assert first["output"]["role"] == "tool" and first["output"]["tool_call_id"] == "call-1"
    assert "[stdout]\nset" in first["output"]["content"]
    assert sid in first["output"]["content"]  # the model learns its session id
    second = invoke(api, {"code": "total + 2", "session_id": sid})
    assert second["session_id"] == sid
    assert "[result]\n42" in second["output"]["content"]
    api.delete(f"/v1/sessions/{sid}")


def test_output_shapes_with_an_image(api: httpx.Client) -> None:
    sid = invoke(api, {"code": "1"})["session_id"]
    args = {"code": PLOT, "session_id": sid}

    chat = invoke(api, args, "openai_chat")
    assert "drawn" in chat["output"]["content"]
    [extra] = chat["extra_messages"]
    url = extra["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).format == "PNG"

    responses = invoke(api, args, "openai_responses")["output"]
    assert responses["type"] == "function_call_output" and responses["call_id"] == "call-1"
    kinds = [part["type"] for part in responses["output"]]
    assert kinds == ["input_text", "input_image"]

    anthropic = invoke(api, args, "anthropic")["output"]
    assert anthropic["type"] == "tool_result" and anthropic["tool_use_id"] == "call-1"
    assert anthropic["is_error"] is False
    image = anthropic["content"][1]
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    Image.open(io.BytesIO(base64.b64decode(image["source"]["data"]))).verify()

    mcp = invoke(api, args, "mcp")["output"]
    assert mcp["isError"] is False
    assert [c["type"] for c in mcp["content"]] == ["text", "image"]
    assert mcp["content"][1]["mimeType"] == "image/png"
    api.delete(f"/v1/sessions/{sid}")


def test_errors_read_well(api: httpx.Client) -> None:
    out = invoke(api, {"code": "def f():\n    return {}['missing']\nf()"}, "anthropic")
    assert out["status"] == "error"
    text = out["output"]["content"][0]["text"]
    assert "[error] KeyError: 'missing'" in text and "return {}['missing']" in text
    assert out["output"]["is_error"] is True
    api.delete(f"/v1/sessions/{out['session_id']}")


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ('{"code": "print(1)"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"session_id": "s-x"}, "'code' is missing"),
        ({"code": 123}, "'code' input should be a valid string"),
        ({"code": ""}, "'code' is empty"),
        ("", "'code' is missing"),
        ("[" * 100_000, "nest too deeply or hold a number too long"),  # was a 500
        ("9" * 5_000, "nest too deeply or hold a number too long"),  # was a 500
    ],
)
def test_malformed_calls_come_back_as_tool_output(
    api: httpx.Client, arguments: object, says: str
) -> None:
    for fmt in ("openai_chat", "anthropic"):
        out = invoke(api, arguments, fmt)
        assert out["status"] == "invalid_call" and out["session_id"] is None
        text = (
            out["output"]["content"]
            if fmt == "openai_chat"
            else out["output"]["content"][0]["text"]
        )
        assert says in text, text
        assert '{"code": "print(1 + 1)"}' in text  # shows the right shape


def test_unknown_session_tells_the_model_what_to_do(api: httpx.Client) -> None:
    out = invoke(api, {"code": "1", "session_id": "s-000000000000000000000000"})
    assert out["status"] == "session_error"
    assert "no session" in out["output"]["content"]
    assert "Omit session_id" in out["output"]["content"]


def test_long_output_is_trimmed_with_a_link_to_all_of_it(api: httpx.Client) -> None:
    out = invoke(api, {"code": "for i in range(5000): print('line', i)"})
    text = out["output"]["content"]
    assert len(text) < 4000  # the server's tool_output_max_chars is 2000
    assert "line 0\n" in text and "line 4999" in text
    assert "characters of output were left out" in text
    link = text.split("The full output: GET ", 1)[1].split()[0]
    full = api.get(link).json()
    assert full["stdout"].count("\n") == 5000
    assert api.get(link + "/stdout").text.endswith("line 4999\n")
    api.delete(f"/v1/sessions/{out['session_id']}")


def test_timeouts_and_dead_kernels_are_explained(api: httpx.Client) -> None:
    sid = invoke(api, {"code": "x = 1"})["session_id"]
    died = invoke(api, {"code": "import os; os._exit(1)", "session_id": sid})
    assert died["status"] == "kernel_died"
    assert "KernelDied" in died["output"]["content"]
    assert "earlier variables are gone" in died["output"]["content"]
    again = invoke(api, {"code": "'x' in globals()", "session_id": sid})
    assert "[result]\nFalse" in again["output"]["content"]
    api.delete(f"/v1/sessions/{sid}")


def test_call_id_is_required_where_the_api_needs_it(api: httpx.Client) -> None:
    for fmt in ("openai_chat", "openai_responses", "anthropic"):
        r = api.post(
            "/v1/tools/code_interpreter/invoke", json={"arguments": {"code": "1"}, "format": fmt}
        )
        assert r.status_code == 422 and "call_id is required" in r.json()["error"]["message"]


def test_many_images_are_attached_up_to_the_limit(api: httpx.Client) -> None:
    out = invoke(
        api,
        {
            "code": "import matplotlib.pyplot as plt\n"
            "for i in range(25):\n    plt.plot([i]); plt.show()"
        },
        "anthropic",
    )
    blocks = out["output"]["content"]
    assert sum(1 for b in blocks if b["type"] == "image") == 20
    assert "20 of them are attached" in blocks[0]["text"]
    api.delete(f"/v1/sessions/{out['session_id']}")


def test_a_caller_that_leaves_an_invoke_interrupts_its_code(api: httpx.Client) -> None:
    sid = invoke(api, {"code": "import time"})["session_id"]
    with pytest.raises(httpx.ReadTimeout):  # the caller gives up after 2 s and leaves
        api.post(
            "/v1/tools/code_interpreter/invoke",
            json={
                "arguments": {"code": "time.sleep(60); finished = True", "session_id": sid},
                "call_id": "call-1",
            },
            timeout=2,
        )
    started = time.monotonic()
    after = invoke(api, {"code": "'finished' in globals()", "session_id": sid})
    assert "[result]\nFalse" in after["output"]["content"]
    assert time.monotonic() - started < 20  # not behind a 60 s sleep
    api.delete(f"/v1/sessions/{sid}")
