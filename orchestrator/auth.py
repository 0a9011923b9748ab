"""Who is calling: a bearer key, told apart by `Principals` (the settings' keys and the keys the
CLI made), and known afterwards by its principal's owner id, never by the key."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException, Request
from starlette.requests import HTTPConnection

from orchestrator.config import Settings
from orchestrator.governance.policy import Principal
from orchestrator.governance.principals import LOCAL_OWNER, NO_KEYS_YET, Principals, owner_of
from orchestrator.key_throttle import KeyThrottle, TooManyWrongKeys
from orchestrator.settings_sections import AuthSection

__all__ = ["LOCAL_OWNER", "Authenticator", "WrongKeysThrottled", "client_address", "owner_of"]


class WrongKeysThrottled(HTTPException):
    """429: the key was not checked, its client being over its budget of wrong keys."""

    kind = "TooManyWrongKeys"

    def __init__(self, refused: TooManyWrongKeys) -> None:
        super().__init__(429, str(refused), headers={"Retry-After": str(refused.retry_after_s)})


def key_throttle(settings: Settings) -> KeyThrottle:
    """The service's one throttle of wrong keys, with the settings' budgets."""
    return KeyThrottle(
        settings.auth_failures_per_minute,
        settings.auth_failures_per_minute_per_key_prefix,
        settings.auth_throttle_max_tracked,
    )


def client_address(connection: HTTPConnection) -> str | None:
    """The client's address as the server saw it (as a proxy named in `forwarded_allow_ips`
    gave it in X-Forwarded-For)."""
    return connection.client.host if connection.client is not None else None


class Authenticator:
    """Every front door's check of a key (REST, MCP, the E2B front, terminals' WebSockets).
    It is made before the service starts; `principals` gives the service's once it has (until
    then, the settings' keys alone answer). Wrong keys are throttled per client address and
    key prefix (`throttle`, shared with the console's login: key_throttle.py)."""

    def __init__(
        self,
        settings: Settings,
        principals: Callable[[], Principals | None] | None = None,
        throttle: KeyThrottle | None = None,
    ) -> None:
        self.disabled = settings.auth_disabled
        self._principals = principals
        self._settings_only = Principals(AuthSection.of(settings), None)
        self.throttle = throttle if throttle is not None else key_throttle(settings)

    def principals(self) -> Principals:
        found = self._principals() if self._principals is not None else None
        return found if found is not None else self._settings_only

    def __call__(self, request: Request) -> str:
        """FastAPI dependency: the caller's owner id, or 401."""
        return self.principal(request).id

    def principal(self, request: Request) -> Principal:
        """The caller, or 401 (429 while its address guesses keys)."""
        if self.disabled:
            return self.principal_for_key("")
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise HTTPException(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return self.principal_for_key(key, client_address(request))

    def owner_for_key(self, key: str, client: str | None = None) -> str:
        """The owner id of a key given in any header, or 401 (LOCAL_OWNER when auth is off);
        `client`: the address that sent it (see principal_for_key)."""
        return self.principal_for_key(key, client).id

    def principal_for_key(self, key: str, client: str | None = None) -> Principal:
        """The principal of `key`, sent from the address `client`: 401 if the key does not
        work (counted against `client` and the key's prefix), 429 `WrongKeysThrottled`,
        unchecked, while `client` is over its budget of wrong keys. No key costs nothing."""
        principals = self.principals()
        counted = not self.disabled and bool(key.strip())
        if counted:
            try:
                self.throttle.before_check(client, key)
            except TooManyWrongKeys as refused:
                raise WrongKeysThrottled(refused) from None
        found = principals.authenticate(key)
        if found is None:
            if counted:
                self.throttle.failed(client, key)
            raise HTTPException(
                401,
                "invalid API key (unknown, revoked, or replaced by a rotation)"
                if principals.has_keys
                else NO_KEYS_YET,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found
