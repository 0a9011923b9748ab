"""Inbound ports on the wire: a session that asks for them has the servers its code starts
reached through the service (`/v1/sessions/{id}/ports/{port}/...`, or `<port>-<id>.<domain>`
where the operator gives a domain). Off unless asked for; the session's network policy is
another matter (what its code may reach), unchanged by this."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# A Host header value: printable, no spaces or line breaks; `${PORT}` stands for the port.
HostMask = Annotated[str, StringConstraints(pattern=r"^[!-~]{1,253}$")]

# Where a port token is presented (or the owner's API key, as for any call). E2B's header is
# taken too: E2B's SDK users send their sandbox's traffic token in it.
PORT_TOKEN_HEADER = "x-port-token"
E2B_TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"


class PortsRequest(BaseModel):
    """What a session asks for its ports, at creation."""

    model_config = ConfigDict(extra="forbid")

    public: bool = Field(
        False,
        description="Anyone who can reach the service may reach its ports, with no key or "
        "token (E2B's default). Otherwise a request needs the session's owner key or its port "
        "token (header X-Port-Token). The operator may forbid public ports (403).",
    )
    host_header: HostMask | None = Field(
        None,
        description="The Host header its servers are sent (E2B's mask_request_host), "
        "`${PORT}` replaced by the port: e.g. `localhost:${PORT}` for a server that only "
        "answers its own name. Unset: the Host the client sent.",
    )


class PortAccess(BaseModel):
    """How a session's ports are reached: kept with the session (its record), told to its
    owner in the session's info."""

    public: bool
    token: str = Field(
        description="The session's port token: send it as X-Port-Token (or E2B's "
        "E2B-Traffic-Access-Token) to reach its ports without the owner's key."
    )
    host_header: HostMask | None = None

    def host_for(self, port: int, asked: str) -> str:
        """The Host its server on `port` is sent, for a request that named `asked`."""
        if self.host_header is None:
            return asked
        return self.host_header.replace("${PORT}", str(port))


class PortsInfo(BaseModel):
    """A session's inbound ports, as its owner sees them."""

    public: bool
    token: str = Field(description="Its port token (header X-Port-Token).")
    path: str = Field(
        description="Where port N is reached on the service: this path with {port} replaced.",
        examples=["/v1/sessions/4f1c.../ports/{port}/"],
    )
    host: str | None = Field(
        None,
        description="The host that reaches port N, with {port} replaced, where the operator "
        "gave the service a domain for ports (ports_domain); null otherwise.",
        examples=["{port}-4f1c....sandboxes.example.com"],
    )
