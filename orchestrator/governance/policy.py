"""A key's policy and the principal it belongs to: what a key may use, and who it is.

Every field left unset (None) is no restriction of the key's own: the service's settings still
bound it (its backends, images, network ceiling, limits ceilings and caps). The keys named in the
settings (`api_keys`) are full access; keys made with `code-interpreter keys add` carry a policy.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from code_interpreter_wire.errors import UnknownLanguage
from code_interpreter_wire.languages import canonical_language
from code_interpreter_wire.network_policy import NetworkPolicy, policy_from_text
from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.registry import BACKENDS

MAX_NAMES = 256  # the most names one rule lists (backends, images, languages, tools)
MAX_NAME_CHARS = 256


class Policy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backends: list[str] | None = Field(None, description="Backends its sessions may use.")
    images: list[str] | None = Field(None, description="Kernel images (docker) it may ask for.")
    languages: list[str] | None = Field(None, description="Languages its code may run in.")
    network: NetworkPolicy | None = Field(
        None, description="The most network its sessions may have (within the service's ceiling)."
    )
    host_tools: list[str] | None = Field(
        None, description="Host tools its sessions may be given and call."
    )
    approval_tools: list[str] = Field(
        default_factory=list, description="Host tools whose every call waits for a human."
    )
    approve_executions: bool = Field(False, description="Every execution waits for a human.")
    approve_commands: bool = Field(
        False, description="Every command, background process and terminal waits for a human."
    )
    commands: bool = Field(
        True, description="Shell commands, background processes and terminals are allowed."
    )
    max_limits: dict[str, float] | None = Field(
        None, description="Ceilings on the resource limits its sessions may ask for, by name."
    )
    max_sessions: int | None = Field(None, ge=0, description="Sessions it may hold at once.")
    volumes: Literal["read_write", "read_only", "none"] = Field(
        "read_write",
        description="Its volumes: made, written and mounted as it likes (read_write); mounted "
        "read-only and not changed from outside, none made (read_only); none at all (none).",
    )
    self_approve: bool = Field(
        False, description="It may answer the approval requests of its own sessions."
    )

    @field_validator("backends", "images", "languages", "host_tools", "approval_tools")
    @classmethod
    def _bounded_names(cls, names: list[str] | None) -> list[str] | None:
        """A policy file is input too: its lists and names are capped."""
        if names is None:
            return None
        if len(names) > MAX_NAMES:
            raise ValueError(f"at most {MAX_NAMES} names")
        for name in names:
            if not name.strip() or len(name) > MAX_NAME_CHARS:
                raise ValueError(f"a name must be 1 to {MAX_NAME_CHARS} characters: {name[:40]!r}")
        return list(dict.fromkeys(name.strip() for name in names))

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, names: list[str] | None) -> list[str] | None:
        unknown = [n for n in names or [] if n not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {unknown[0]!r}; backends are: {', '.join(BACKENDS)}")
        return names

    @field_validator("languages")
    @classmethod
    def _canonical_languages(cls, names: list[str] | None) -> list[str] | None:
        """Kept by their canonical names (`js` is javascript), as executions are checked."""
        if names is None:
            return None
        try:
            return list(dict.fromkeys(canonical_language(n) for n in names))
        except UnknownLanguage as exc:
            raise ValueError(str(exc)) from None

    @field_validator("network", mode="before")
    @classmethod
    def _network_text(cls, value: Any) -> Any:
        """`none`, `any` or `host:port,...` as the settings write it."""
        return policy_from_text(value) if isinstance(value, str) else value

    @field_validator("max_limits")
    @classmethod
    def _known_limits(cls, limits: dict[str, float] | None) -> dict[str, float] | None:
        if limits is None:
            return None
        known = ResourceLimits.model_fields
        for name, value in limits.items():
            if name not in known:
                raise ValueError(f"unknown limit {name!r}; limits are: {', '.join(known)}")
            try:  # a ceiling no session could have (below the limit's minimum) is a mistake
                ResourceLimits.model_validate({name: value})
            except ValidationError as exc:
                raise ValueError(f"{name}: {exc.errors()[0]['msg']}") from None
        return limits

    def describe_rules(self) -> dict[str, Any]:
        """The rules that restrict anything, as people read them (`keys show`, whoami)."""
        return self.model_dump(mode="json", exclude_defaults=True)


FULL_ACCESS = Policy(self_approve=True)


class Principal(BaseModel):
    """Who a request comes from: the owner id its sessions, snapshots and audit events carry
    (stable across key rotation), a name people read, and its policy."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    admin: bool = False
    policy: Policy = FULL_ACCESS

    def may_answer(self, owner: str) -> bool:
        """Whether it may approve or deny a request made by a session of `owner`."""
        return self.admin or (owner == self.id and self.policy.self_approve)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "admin": self.admin}
