"""Logging in with a key (a form POST that sets the console's cookie) and out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from orchestrator.auth import client_address
from orchestrator.console.console_auth import (
    COOKIE,
    MAX_KEY_CHARS,
    WHY,
    NotLoggedIn,
    Viewer,
    check_post,
)
from orchestrator.console.context import base, console_of
from orchestrator.console.render import page
from orchestrator.key_throttle import TooManyWrongKeys

router = APIRouter()


def login_form(
    request: Request, message: str | None = None, *, refused: bool = False, status: int = 200
) -> Response:
    return page(
        "login.html",
        status,
        title="Log in",
        base=base(request),
        viewer=None,
        section="login",
        message=message,
        refused=refused,
        auth_disabled=console_of(request).service.admission.auth_disabled,
        max_key_chars=MAX_KEY_CHARS,
    )


@router.get("/")
async def home(request: Request) -> Response:
    return RedirectResponse(f"{base(request)}/sessions", 303)


@router.get("/login")
async def login_page(request: Request) -> Response:
    why = request.query_params.get("why")
    return login_form(request, WHY.get(why) if why else None)


@router.post("/login")
async def log_in(request: Request, key: Annotated[str, Form()] = "") -> Response:
    check_post(request, None, "")
    auth = console_of(request).auth
    if len(key.strip()) > MAX_KEY_CHARS:
        return login_form(
            request,
            f"That is not a key of this service: keys are at most {MAX_KEY_CHARS} characters.",
            refused=True,
            status=401,
        )
    try:
        found = await auth.log_in(key, client_address(request))
    except TooManyWrongKeys as refused:
        response = login_form(
            request,
            f"Too many wrong keys from your address: wait {refused.retry_after_s} s, then "
            "try again.",
            refused=True,
            status=429,
        )
        response.headers["Retry-After"] = str(refused.retry_after_s)
        return response
    if found is None:
        return login_form(
            request,
            "That key does not work here (unknown, revoked or expired): check it, or ask an "
            "admin for one (code-interpreter keys add).",
            refused=True,
            status=401,
        )
    _, token = found
    response = RedirectResponse(f"{base(request)}/sessions", 303)
    response.set_cookie(
        COOKIE,
        token,
        max_age=int((await auth.tokens()).ttl_s),
        path=base(request) or "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def log_out(request: Request, csrf: Annotated[str, Form()] = "") -> Response:
    try:
        viewer: Viewer | None = await console_of(request).auth.viewer(request)
    except NotLoggedIn:
        viewer = None  # logged out already: nothing to protect
    check_post(request, viewer, csrf)
    if viewer is not None:
        console_of(request).auth.log_out(viewer)
    return logged_out(request, "out")


def logged_out(request: Request, why: str) -> Response:
    """Back to the login form, saying why, the cookie gone. A page htmx polls is sent there
    whole (HX-Redirect), not swapped into a part of the page."""
    url = f"{base(request)}/login?why={why}"
    response: Response
    if request.headers.get("hx-request") == "true":
        response = Response(status_code=200, headers={"HX-Redirect": url})
    else:
        response = RedirectResponse(url, 303)
    response.delete_cookie(COOKIE, path=base(request) or "/", httponly=True, samesite="strict")
    return response
