"""A rendered tool output in the shape each agent API expects, images where the API takes them."""

from __future__ import annotations

import base64

import pytest

from code_interpreter_wire.tool_arguments import TOOL_NAME
from code_interpreter_wire.tool_definitions import ToolFormat
from code_interpreter_wire.tool_output import (
    MAX_INLINE_IMAGES,
    Image,
    RenderedOutput,
    format_output,
)

pytestmark = pytest.mark.unit

PNG = Image("image/png", b"\x89PNG one", "http://127.0.0.1:8000/v1/sessions/s1/artifacts/a1")
JPEG_UNKEPT = Image("image/jpeg", b"\xff\xd8 two", None)
SVG = Image("image/svg+xml", b"<svg/>", "http://127.0.0.1:8000/v1/sessions/s1/artifacts/a3")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(image: Image) -> str:
    return f"data:{image.mime_type};base64,{b64(image.data)}"


def text_only(is_error: bool = False) -> RenderedOutput:
    return RenderedOutput("[stdout]\nhi\n[status] ok", [], is_error=is_error)


def with_images() -> RenderedOutput:
    return RenderedOutput("[images] 3", [PNG, JPEG_UNKEPT, SVG], is_error=False)


def test_chat_without_images_is_one_tool_message() -> None:
    out = format_output(ToolFormat.OPENAI_CHAT, text_only(), call_id="call_1", inline_images=True)
    assert out == {
        "output": {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "[stdout]\nhi\n[status] ok",
        },
        "extra_messages": [],
    }


def test_chat_images_go_in_an_extra_user_message() -> None:
    out = format_output(ToolFormat.OPENAI_CHAT, with_images(), call_id="c9", inline_images=False)
    assert out["output"] == {"role": "tool", "tool_call_id": "c9", "content": "[images] 3"}
    assert out["extra_messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Images from {TOOL_NAME} call c9:"},
                {"type": "image_url", "image_url": {"url": PNG.url}},
                # Not kept, so no link: it travels inline even when links were asked for.
                {"type": "image_url", "image_url": {"url": data_url(JPEG_UNKEPT)}},
            ],
        }
    ]


def test_chat_inline_images_are_data_urls() -> None:
    out = format_output(ToolFormat.OPENAI_CHAT, with_images(), call_id="c9", inline_images=True)
    urls = [p["image_url"]["url"] for p in out["extra_messages"][0]["content"][1:]]
    assert urls == [data_url(PNG), data_url(JPEG_UNKEPT)]


def test_a_missing_call_id_becomes_empty() -> None:
    out = format_output(ToolFormat.OPENAI_CHAT, text_only(), call_id=None, inline_images=True)
    assert out["output"]["tool_call_id"] == ""


def test_responses_text_only_is_a_string() -> None:
    out = format_output(
        ToolFormat.OPENAI_RESPONSES, text_only(), call_id="fc_1", inline_images=True
    )
    assert out == {
        "output": {
            "type": "function_call_output",
            "call_id": "fc_1",
            "output": "[stdout]\nhi\n[status] ok",
        },
        "extra_messages": [],
    }


def test_responses_with_images_is_a_list_of_inputs() -> None:
    out = format_output(
        ToolFormat.OPENAI_RESPONSES, with_images(), call_id="fc_1", inline_images=False
    )
    assert out["output"]["output"] == [
        {"type": "input_text", "text": "[images] 3"},
        {"type": "input_image", "image_url": PNG.url},
        {"type": "input_image", "image_url": data_url(JPEG_UNKEPT)},
    ]
    assert out["extra_messages"] == []


def test_anthropic_links_are_url_sources_and_the_rest_base64() -> None:
    out = format_output(ToolFormat.ANTHROPIC, with_images(), call_id="toolu_1", inline_images=False)
    assert out["output"] == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [
            {"type": "text", "text": "[images] 3"},
            {"type": "image", "source": {"type": "url", "url": PNG.url}},
            {
                "type": "image",
                "source": {
                    "type": "base64",
                    "media_type": "image/jpeg",
                    "data": b64(JPEG_UNKEPT.data),
                },
            },
        ],
        "is_error": False,
    }


def test_anthropic_inline_images_are_all_base64() -> None:
    out = format_output(ToolFormat.ANTHROPIC, with_images(), call_id="t", inline_images=True)
    sources = [block["source"] for block in out["output"]["content"][1:]]
    assert sources == [
        {"type": "base64", "media_type": "image/png", "data": b64(PNG.data)},
        {"type": "base64", "media_type": "image/jpeg", "data": b64(JPEG_UNKEPT.data)},
    ]


@pytest.mark.parametrize("is_error", [True, False])
def test_anthropic_and_mcp_carry_the_error_flag(is_error: bool) -> None:
    anthropic = format_output(
        ToolFormat.ANTHROPIC, text_only(is_error), call_id="t", inline_images=True
    )
    mcp = format_output(ToolFormat.MCP, text_only(is_error), call_id=None, inline_images=True)
    assert anthropic["output"]["is_error"] is is_error
    assert mcp["output"]["isError"] is is_error


@pytest.mark.parametrize("inline_images", [True, False])
def test_mcp_images_always_travel_inline(inline_images: bool) -> None:
    out = format_output(ToolFormat.MCP, with_images(), call_id=None, inline_images=inline_images)
    assert out == {
        "output": {
            "content": [
                {"type": "text", "text": "[images] 3"},
                {"type": "image", "data": b64(PNG.data), "mimeType": "image/png"},
                {"type": "image", "data": b64(JPEG_UNKEPT.data), "mimeType": "image/jpeg"},
            ],
            "isError": False,
        },
        "extra_messages": [],
    }


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_no_format_attaches_an_svg_or_more_than_the_cap(fmt: ToolFormat) -> None:
    many = [Image("image/png", bytes([i]), None) for i in range(MAX_INLINE_IMAGES + 3)]
    out = format_output(
        fmt, RenderedOutput("t", [SVG, *many], False), call_id="c", inline_images=True
    )
    flat = repr(out)
    assert "svg" not in flat
    assert flat.count("image/png") == MAX_INLINE_IMAGES
