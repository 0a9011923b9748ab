"""The HTTP client's calls on secrets (docs/secrets.md): `AsyncClient` and `Client` have them.
A value goes to the service as it is (checked there only: a local validation error would
print it) and never comes back."""

from __future__ import annotations

from typing import Any

from code_interpreter_client.http_answers import HttpCalls
from code_interpreter_client.http_answers import checked as _check
from code_interpreter_client.http_answers import segment as _segment
from code_interpreter_wire.background_loop import run_sync
from code_interpreter_wire.secrets import SecretInfo, SecretList


class SecretCalls(HttpCalls):
    """Secrets; sessions ask for them by name (`secrets=["NAME"]`)."""

    async def store_secret(
        self,
        name: str,
        value: str,
        hosts: list[str],
        *,
        methods: list[str] | None = None,
        path_prefixes: list[str] | None = None,
        headers: list[str] | None = None,
    ) -> SecretInfo:
        """Store (or replace) a secret bound to `hosts` (and `methods`, `path_prefixes`, when
        given), put only into the request headers `headers` names (unset: the service's
        default, `authorization`, `x-api-key`, `api-key`); its value is never answered back."""
        # Checked by the service only: a local validation error would print the value.
        body: dict[str, Any] = {"name": name, "value": value, "hosts": hosts}
        if methods is not None:
            body["methods"] = methods
        if path_prefixes is not None:
            body["path_prefixes"] = path_prefixes
        if headers is not None:
            body["headers"] = headers
        return SecretInfo.model_validate(await self._json("POST", "/v1/secrets", json=body))

    async def list_secrets(self) -> list[SecretInfo]:
        return SecretList.model_validate(await self._json("GET", "/v1/secrets")).secrets

    async def get_secret(self, name: str) -> SecretInfo:
        return SecretInfo.model_validate(await self._json("GET", f"/v1/secrets/{_segment(name)}"))

    async def delete_secret(self, name: str) -> None:
        _check(await self.http.delete(f"/v1/secrets/{_segment(name)}"))


class BlockingSecretCalls:
    """`SecretCalls`, blocking."""

    api: SecretCalls

    def store_secret(
        self,
        name: str,
        value: str,
        hosts: list[str],
        *,
        methods: list[str] | None = None,
        path_prefixes: list[str] | None = None,
        headers: list[str] | None = None,
    ) -> SecretInfo:
        return run_sync(
            self.api.store_secret(
                name, value, hosts, methods=methods, path_prefixes=path_prefixes, headers=headers
            )
        )

    def list_secrets(self) -> list[SecretInfo]:
        return run_sync(self.api.list_secrets())

    def get_secret(self, name: str) -> SecretInfo:
        return run_sync(self.api.get_secret(name))

    def delete_secret(self, name: str) -> None:
        run_sync(self.api.delete_secret(name))
