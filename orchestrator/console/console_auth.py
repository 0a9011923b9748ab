"""Who is looking at the console: logged in with one of the service's keys, checked again on
every request (a key revoked or rotated out is logged out at once), and the CSRF token each of
its forms must carry back."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import Request

from orchestrator.console.key_check import KeyCheck
from orchestrator.console.login_tokens import Login, LoginTokens, key_digest, load_secret
from orchestrator.governance.policy import Principal

if TYPE_CHECKING:
    from orchestrator.front_config import FrontConfig
    from orchestrator.key_throttle import KeyThrottle
    from orchestrator.service import Service

COOKIE = "cir_console"
MAX_KEY_CHARS = 512  # longer than any key this service makes or takes from its settings
MAX_ENDED = 10_000  # logged-out logins remembered until their expiry

# Why a page sent its reader to the login form: fixed words, never text from a request.
WHY = {
    "expired": "Your login expired: log in again.",
    "revoked": "Your key no longer works (revoked or rotated): log in with a current key.",
    "out": "You are logged out.",
    "none": "Log in with one of this service's API keys.",
}


class NotLoggedIn(Exception):
    """No valid login: the page sends its reader to the login form, saying why (a WHY key)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class BadForm(Exception):
    """A POST without this login's CSRF token, or from another origin: refused (403)."""


@dataclass(frozen=True)
class Viewer:
    principal: Principal
    login: Login
    csrf: str

    @property
    def admin(self) -> bool:
        return self.principal.admin

    @property
    def owner_filter(self) -> str | None:
        """The owner whose things this viewer sees; None: everyone's (an admin)."""
        return None if self.principal.admin else self.principal.id


class ConsoleAuth:
    def __init__(self, service: Service, fronts: FrontConfig, throttle: KeyThrottle) -> None:
        """`throttle`: counts wrong keys with the API's (the same budgets per address)."""
        self._service = service
        self._fronts = fronts
        self.throttle = throttle
        self._tokens: LoginTokens | None = None
        self._keys = KeyCheck(service)
        # Logins ended by a logout, until they would have expired anyway (this replica's).
        self._ended: dict[str, float] = {}

    async def tokens(self) -> LoginTokens:
        """Signed with the `console_secret` setting (every replica's the same), else with the
        secret under the state dir (made the first time it is needed)."""
        if self._tokens is None:
            fronts = self._fronts
            if fronts.console_secret is not None:
                secret = fronts.console_secret.get_secret_value().encode()
            else:
                secret = await asyncio.to_thread(load_secret, fronts.state_dir)
            self._tokens = LoginTokens(secret)
        return self._tokens

    async def log_in(self, key: str, client: str | None) -> tuple[Principal, str] | None:
        """The principal of `key`, sent from the address `client`, and a login token for it;
        None for a key that does not work here (unknown, revoked, rotated out): counted as the
        API counts wrong keys, and `TooManyWrongKeys`, unchecked, while `client` is over its
        budget (key_throttle.py). With auth off, everyone is `local`."""
        key = key.strip()
        counted = bool(key) and not self._auth_off
        if counted:
            self.throttle.before_check(client, key)
        principal = self._service.admission.authenticate(key) if len(key) <= MAX_KEY_CHARS else None
        if principal is None:
            if counted:
                self.throttle.failed(client, key)
            return None
        digest = "" if self._auth_off else key_digest(key)
        return principal, (await self.tokens()).issue(principal.id, digest)

    @property
    def _auth_off(self) -> bool:
        return self._service.admission.auth_disabled

    async def viewer(self, request: Request) -> Viewer:
        """The logged-in reader of this request, checked again now; else NotLoggedIn."""
        token = request.cookies.get(COOKIE)
        if not token:
            raise NotLoggedIn("none")
        tokens = await self.tokens()
        login = tokens.read(token)
        if login is None:
            raise NotLoggedIn("expired")
        if login.nonce in self._ended:
            raise NotLoggedIn("out")
        if self._auth_off:
            principal = self._service.admission.authenticate("")
        elif login.key_digest:
            principal = await self._keys.principal(login.key_digest, login.principal_id)
        else:  # a login made while auth was off: not once it is on
            principal = None
        if principal is None:
            raise NotLoggedIn("revoked")
        return Viewer(principal, login, tokens.csrf(login))

    def log_out(self, viewer: Viewer) -> None:
        """End the login for good, not only its cookie (a copy of the cookie stops working)."""
        now = time.time()
        if len(self._ended) >= MAX_ENDED:
            self._ended = {n: t for n, t in self._ended.items() if t > now}
            while len(self._ended) >= MAX_ENDED:
                del self._ended[next(iter(self._ended))]
        self._ended[viewer.login.nonce] = viewer.login.expires_at


def check_post(request: Request, viewer: Viewer | None, csrf: str) -> None:
    """A form POST: from this origin (when the browser says), and, once logged in, carrying
    this login's CSRF token."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise BadForm("this form was sent from another site")
    if viewer is not None and not hmac.compare_digest(csrf.encode(), viewer.csrf.encode()):
        raise BadForm("this form is stale (its security token does not match your login)")
