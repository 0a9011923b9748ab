"""The console's pages from its Jinja2 templates: escaped always (what sandboxes and keys send is
shown, never run), and the few filters the templates share."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

TEMPLATES = Path(__file__).parent / "templates"

_environment = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(t: float | datetime | None) -> str:
    if t is None:
        return ""
    moment = t if isinstance(t, datetime) else datetime.fromtimestamp(t, UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _seconds(s: float | None) -> str:
    if s is None:
        return ""
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _size(n: int | float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


_environment.filters.update(when=_when, seconds=_seconds, size=_size)


def page(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A template rendered whole (a page, or the fragment htmx swaps in)."""
    return HTMLResponse(_environment.get_template(name).render(**context), status_code)


def text(name: str, **context: Any) -> str:
    return _environment.get_template(name).render(**context)


def poll_block(element_id: str, url: str, inner: str, every_s: float = 2.0) -> Markup:
    """A part of a page that htmx asks for again (GET `url`) every `every_s`, carrying the
    version of what it shows."""
    version = _version(inner)
    sep = "&" if "?" in url else "?"
    return (
        Markup(
            f'<div id="{escape(element_id)}" hx-get="{escape(url)}{sep}v={version}" '
            f'hx-trigger="every {every_s:g}s" hx-swap="outerHTML">'
        )
        + Markup(inner)
        + Markup("</div>")
    )


def polled(request: Request, element_id: str, url: str, inner: str) -> Response:
    """The answer to a poll: 204 (nothing to swap, so what a reader has open or is typing
    stays) while the content is what the page already shows, else the new block."""
    if request.query_params.get("v") == _version(inner):
        return Response(status_code=204)
    return HTMLResponse(str(poll_block(element_id, url, inner)))


def _version(inner: str) -> str:
    return hashlib.sha256(inner.encode()).hexdigest()[:16]
