"""What every call of the HTTP client shares: how an id or a path goes into a URL, and how an
error answer becomes an `APIError`."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx


class APIError(Exception):
    """The service answered with an error: its HTTP status, error type and message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message


def segment(value: str) -> str:
    """An id as one path segment: slashes and `..` in it name no other route (an id handed
    over by a model or a store could otherwise reach another of the key's resources)."""
    quoted = quote(value, safe="")
    return quoted if quoted not in (".", "..") else quoted.replace(".", "%2E")


def file_path(value: str) -> str:
    """A file's path in a URL: its names quoted, its slashes kept (the service refuses `..`)."""
    return quote(value, safe="/")


def checked(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        error = response.json()["error"]
        raise APIError(response.status_code, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        raise APIError(response.status_code, "HTTPError", response.text) from None


class HttpCalls:
    """What the client's calls are made with: its connection, and a call answered in JSON."""

    http: httpx.AsyncClient

    async def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        return checked(await self.http.request(method, url, **kwargs)).json()
