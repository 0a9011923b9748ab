"""An execution's kept output as the console shows it: its first KiB of each stream with a note
of what was cut, its results' text, its images by id. Read once (kept executions never change)
and remembered in a small cache, so a page polled every second or two reads no file again. In a
cluster the shared store may be down a while: the page says so, and reads it again next time."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from code_interpreter_wire.results import Execution
from orchestrator.outputs import OutputEvicted, OutputNotFound
from orchestrator.state_store.redis_connection import StoreUnavailable

if TYPE_CHECKING:
    from orchestrator.service import Service

SHOWN_CHARS = 8 * 1024  # of each stream, the traceback, and the code
RESULT_CHARS = 2 * 1024  # of each result's text
MAX_RESULTS = 10
MAX_IMAGES = 8
MAX_PARSED_BYTES = 8 << 20  # a kept execution larger than this is not read for the console
CACHED = 128  # executions remembered, each under 6 * SHOWN_CHARS


@dataclass(frozen=True)
class ShownText:
    text: str
    cut: int = 0  # characters left out

    @staticmethod
    def of(text: str, dropped: int = 0, most: int = SHOWN_CHARS) -> ShownText:
        """Its first `most` characters; `dropped`: what a cap before this one left out."""
        if len(text) <= most:
            return ShownText(text, dropped)
        return ShownText(text[:most], len(text) - most + dropped)


@dataclass(frozen=True)
class ShownOutput:
    stdout: ShownText = ShownText("")
    stderr: ShownText = ShownText("")
    results: list[ShownText] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # artifact ids
    error: str | None = None  # the exception's name and value
    traceback: ShownText = ShownText("")
    left_out: int = 0  # results and images not shown
    missing: str | None = None  # why there is nothing to show


def shown(execution: Execution) -> ShownOutput:
    texts = []
    for result in execution.results:
        text = result.text or result.markdown or result.latex
        if text is None and result.json_data is not None:
            text = json.dumps(result.json_data)[: RESULT_CHARS + 1]
        if text is not None and not result.images():
            texts.append(ShownText.of(text, most=RESULT_CHARS))
    artifacts = execution.artifacts
    error = execution.error
    return ShownOutput(
        stdout=ShownText.of(execution.stdout, execution.stdout_dropped),
        stderr=ShownText.of(execution.stderr, execution.stderr_dropped),
        results=texts[:MAX_RESULTS],
        images=[a.id for a in artifacts[:MAX_IMAGES]],
        error=f"{error.name}: {error.value}"[:SHOWN_CHARS] if error is not None else None,
        traceback=ShownText.of(error.traceback if error is not None else ""),
        left_out=max(0, len(texts) - MAX_RESULTS)
        + max(0, len(artifacts) - MAX_IMAGES)
        + execution.results_dropped,
    )


class ShownOutputs:
    def __init__(self, service: Service) -> None:
        self._service = service
        self._cache: OrderedDict[tuple[str, str], ShownOutput] = OrderedDict()

    async def of(self, session_id: str, execution_id: str) -> ShownOutput:
        """The shown output of a kept execution (the caller checked whose session it is)."""
        key = (session_id, execution_id)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        try:
            found = await self._read(session_id, execution_id)
        except StoreUnavailable as exc:  # said on the page, read again at its next poll
            return ShownOutput(missing=f"its output cannot be read just now: {exc}")
        self._cache[key] = found
        while len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return found

    async def _read(self, session_id: str, execution_id: str) -> ShownOutput:
        try:
            kept = await self._service.files.kept_output(session_id, execution_id)
        except OutputEvicted:
            return ShownOutput(
                missing="its output was evicted to respect the quota on kept outputs"
            )
        except OutputNotFound:
            return ShownOutput(missing="its output is gone (kept only while its session lives)")
        if kept.size > MAX_PARSED_BYTES:
            await kept.close()
            return ShownOutput(
                missing=f"its output is too large to show here ({kept.size} bytes): "
                f"GET /v1/sessions/{session_id}/executions/{execution_id} has it whole"
            )
        data = await kept.read()
        return await asyncio.to_thread(_parsed, data)


def _parsed(data: bytes) -> ShownOutput:
    return shown(Execution.model_validate_json(data))
