"""The classic agent loop against any OpenAI-compatible endpoint, with our code interpreter.

Ask the model; run every tool call it makes (concurrently when there are several); append the
tool messages in the calls' order, then any images; repeat until the model answers in plain text.

    python examples/agent_loop.py --base-url https://api.openai.com/v1 --model gpt-4.1
    python examples/agent_loop.py --base-url http://127.0.0.1:11434/v1 --model qwen3 \\
        --csv my.csv --prompt "What stands out in my.csv?"

The key comes from --api-key or OPENAI_API_KEY. Code runs in an embedded sandbox (--backend
local or docker), or in a session of a running service (--server URL, key in
CODE_INTERPRETER_API_KEY). Images the code draws are saved to --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from openai import APIError, AsyncOpenAI

from code_interpreter_client.code_session import CodeSession
from code_interpreter_wire.tool_arguments import TOOL_NAME, ToolCallError, parse_arguments
from code_interpreter_wire.tool_definitions import (
    CODE_ONLY_SCHEMA,
    LIBRARIES,
    ToolFormat,
    description,
)
from code_interpreter_wire.tool_output import format_output

HERE = Path(__file__).parent
DEFAULT_PROMPT = (
    "sales.csv in the working directory has monthly units and revenue per region. Which "
    "region's revenue grew fastest from the first month to the last, and by how much? "
    "Chart revenue by region over the months."
)
SYSTEM = (
    "You are a data analyst. Use the code_interpreter tool to load and analyse data; check "
    "numbers by computing them, never guess. Answer briefly, with the figures."
)


def tool_definition(timeout_s: float) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": description(
                timeout_s=timeout_s, libraries=LIBRARIES, bound_session=True
            ),
            "parameters": CODE_ONLY_SCHEMA,
        },
    }


class AgentLoop:
    def __init__(
        self,
        model: AsyncOpenAI,
        model_name: str,
        session: CodeSession,
        *,
        timeout_s: float,
        output_dir: Path,
        max_turns: int,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.session = session
        self.timeout_s = timeout_s
        self.output_dir = output_dir
        self.max_turns = max_turns
        self.images_saved = 0

    async def run_call(self, call: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One tool call: its tool message, and any messages carrying its images."""
        if call.function.name != TOOL_NAME:
            text = f"[error] there is no tool {call.function.name!r}; use {TOOL_NAME}"
            return {"role": "tool", "tool_call_id": call.id, "content": text}, []
        try:
            code = parse_arguments(call.function.arguments, bound_session=True).code
        except ToolCallError as exc:
            return {"role": "tool", "tool_call_id": call.id, "content": f"[error] {exc}"}, []
        print(f"\n--- {TOOL_NAME} ({call.id})\n{code}")
        execution = await self.session.execute(code, timeout_s=self.timeout_s)
        rendered = self.session.render(execution)
        print(rendered.text)
        for image in rendered.images:
            self.images_saved += 1
            suffix = image.mime_type.split("/")[-1].split("+")[0]
            path = self.output_dir / f"figure-{self.images_saved}.{suffix}"
            path.write_bytes(image.data)
            print(f"(saved {path})")
        out = format_output(ToolFormat.OPENAI_CHAT, rendered, call_id=call.id, inline_images=True)
        return out["output"], out["extra_messages"]

    async def run(self, prompt: str) -> str:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": prompt},
        ]
        tools = [tool_definition(self.timeout_s)]
        for _ in range(self.max_turns):
            response = await self.model.chat.completions.create(
                model=self.model_name,
                messages=messages,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True, exclude_unset=True))
            if not message.tool_calls:
                return message.content or ""
            results = await asyncio.gather(*(self.run_call(c) for c in message.tool_calls))
            # Every tool message first, in the calls' order (the API requires them right after
            # the assistant's message), then the images, which only user messages may carry.
            messages.extend(tool_message for tool_message, _ in results)
            messages.extend(extra for _, extras in results for extra in extras)
        raise RuntimeError(f"no answer after {self.max_turns} turns")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="OpenAI-compatible API base URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--csv", type=Path, default=HERE / "data" / "sales.csv")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--backend", default="local", help="local or docker (embedded)")
    parser.add_argument("--server", help="use a running service instead, at this URL")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per tool call")
    parser.add_argument("--max-turns", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"))
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session: CodeSession
    if args.server:
        session = CodeSession.remote(args.server, os.environ.get("CODE_INTERPRETER_API_KEY"))
    else:
        session = CodeSession.embedded(args.backend)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    async with session:
        await session.upload(args.csv.name, args.csv.read_bytes())
        loop = AgentLoop(
            model,
            args.model,
            session,
            timeout_s=args.timeout,
            output_dir=args.output_dir,
            max_turns=args.max_turns,
        )
        try:
            answer = await loop.run(args.prompt)
        except APIError as exc:
            print(f"error: the model endpoint failed: {exc}", file=sys.stderr)
            return 1
        finally:
            await model.close()
    print(f"\n=== answer\n{answer}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
