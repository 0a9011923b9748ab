"""Host tools that are HTTP endpoints: the arguments go out as JSON (as the query for GET), the
JSON or text answer comes back. The URL and headers (keys, tokens) stay on the host: the sandbox
sees only the name, the description and the schema.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
from pydantic import Field, PrivateAttr

from orchestrator.host_tools.base import HostTool, HostToolError


class HttpTool(HostTool):
    """A host tool that calls an HTTP endpoint."""

    url: str = Field(description="The endpoint, http:// or https://.")
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict, description="Sent with every call.")
    max_response_bytes: int = Field(8 << 20, ge=1, description="A longer answer is refused.")

    _client: httpx.AsyncClient | None = PrivateAttr(default=None)

    async def call(self, arguments: dict[str, Any]) -> Any:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s or 60.0)
        client, url, headers = self._client, self.url, self.headers
        if self.method == "GET":
            query = {k: v if isinstance(v, str) else _query_value(v) for k, v in arguments.items()}
            request = client.build_request("GET", url, params=query, headers=headers)
        else:
            request = client.build_request(self.method, url, json=arguments, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise HostToolError(f"the endpoint could not be reached: {exc}") from None
        try:
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_response_bytes:
                    raise HostToolError(
                        f"the endpoint's answer is over {self.max_response_bytes} bytes"
                    )
        finally:
            await response.aclose()
        text = body.decode(response.encoding or "utf-8", errors="replace")
        if response.is_error:
            raise HostToolError(f"HTTP {response.status_code}: {text[:500]}")
        if "json" in response.headers.get("content-type", ""):
            try:
                return json.loads(body)
            except ValueError:
                return text
        return text

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _query_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()
