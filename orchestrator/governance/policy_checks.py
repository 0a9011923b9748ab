"""What a key's policy allows, asked where the service acts: each check raises `PolicyDenied`
naming the key, the rule and what it allows; each `capped_*` fits what a request left unset
(the service's defaults) within the policy instead of refusing it.

Pure functions of a principal and a request: the service calls them (never a route), so every
front door is held to the same rules."""

from __future__ import annotations

from collections.abc import Iterable

from code_interpreter_wire.network_policy import NO_NETWORK, NetworkPolicy
from code_interpreter_wire.rest import CreateSessionRequest
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.policy import Principal


def _listed(names: Iterable[str]) -> str:
    shown = list(names)
    return ", ".join(shown) if shown else "none"


def _require_listed(
    who: Principal, rule: str, allowed: list[str] | None, asked: str, what: str
) -> None:
    """PolicyDenied (to `what`) unless the rule lists nothing or lists `asked`."""
    if allowed is not None and asked not in allowed:
        raise PolicyDenied.by_rule(who.name, what, rule, f"allows: {_listed(allowed)}")


def _fit_listed(
    who: Principal,
    rule: str,
    allowed: list[str] | None,
    default: str,
    offered: list[str],
    what: str,
    offers: str,
) -> str | None:
    """What a request that named none gets: None where the rule allows the service's default,
    else the first the rule lists that the service offers; PolicyDenied (to `what`) if none
    is ("none of which this service `offers`")."""
    if allowed is None or default in allowed:
        return None
    for name in allowed:
        if name in offered:
            return name
    raise PolicyDenied.by_rule(
        who.name,
        what,
        rule,
        f"allows: {_listed(allowed)}, none of which this service {offers} ({_listed(offered)})",
    )


def check_backend(who: Principal, backend: str) -> None:
    _require_listed(who, "backends", who.policy.backends, backend, f"use the {backend} backend")


def fit_backend(who: Principal, default: str, enabled: list[str]) -> str:
    """The backend of a session that named none: the service's default when the policy allows
    it, else the first backend the policy lists that the service runs."""
    what = f"use the default backend, {default}"
    fitted = _fit_listed(who, "backends", who.policy.backends, default, enabled, what, "runs")
    return fitted or default


def check_image(who: Principal, image: str) -> None:
    _require_listed(who, "images", who.policy.images, image, f"use the image {image!r}")


def _fit_image(who: Principal, default: str, offered: list[str]) -> str | None:
    """The image of a Docker session that asked for none: None (leave it to the backend) when
    the policy allows the service's default, else the first image both allow."""
    what = f"use the default image {default!r}"
    return _fit_listed(who, "images", who.policy.images, default, offered, what, "offers")


# What the `languages` and `commands` rules govern, said in their refusals so that nobody reads
# more into them: they choose what the API starts, not what programs the sandbox holds.
LANGUAGES_SCOPE = (
    "; the rule chooses the kernels the API runs, while code in an allowed language can still "
    "start the sandbox's other programs (subprocess, `!`), inside the sandbox's walls"
)
COMMANDS_SCOPE = (
    "; the rule refuses the commands, processes and terminal APIs, while code the key may run "
    "can still start programs inside its own sandbox (subprocess, `!`), within its walls"
)


def check_language(who: Principal, language: str) -> None:
    """`language`: canonical (as `check_available` returns it)."""
    allowed = who.policy.languages
    if allowed is not None and language not in allowed:
        raise PolicyDenied.by_rule(
            who.name,
            f"run {language} code",
            "languages",
            f"allows: {_listed(allowed)}{LANGUAGES_SCOPE}",
        )


def check_network(who: Principal, asked: NetworkPolicy) -> None:
    most = who.policy.network
    if most is not None and asked.beyond(most) is not None:
        raise PolicyDenied.by_rule(
            who.name,
            f"have the network {asked.describe()!r}",
            "network",
            f"allows at most: {most.describe()}",
        )


def capped_network(who: Principal, default: NetworkPolicy) -> NetworkPolicy:
    """The network of a session that asked for none: the service's default if the policy
    allows it, else the policy's own if that is within the default, else none."""
    most = who.policy.network
    if most is None or default.beyond(most) is None:
        return default
    if most.beyond(default) is None:
        return most
    return NO_NETWORK


def check_tools(who: Principal, tools: Iterable[str]) -> None:
    allowed = who.policy.host_tools
    if allowed is None:
        return
    refused = [t for t in tools if t not in allowed]
    if refused:
        raise PolicyDenied.by_rule(
            who.name,
            f"give its sessions the host tool(s) {_listed(refused)}",
            "host_tools",
            f"allows: {_listed(allowed)}",
        )


def check_volumes(
    who: Principal, *, mounted: int = 0, writable: bool = False, reading: bool = False
) -> None:
    """Volumes under the key's `volumes` rule: `mounted` of them in a new session, `writable`:
    any of them written (a mount not read-only, a change from outside, a new volume),
    `reading`: its volumes or their files read from outside."""
    rule = who.policy.volumes
    if rule == "none" and (mounted or writable or reading):
        raise PolicyDenied.by_rule(who.name, "use volumes", "volumes", "allows none")
    if rule == "read_only" and writable:
        raise PolicyDenied.by_rule(
            who.name,
            "make, change or mount a volume writable",
            "volumes",
            "allows read-only mounts only",
            hint="Mount it with read_only: true",
        )


def allowed_tools(who: Principal, tools: list[str]) -> list[str]:
    """Those of `tools` the policy allows (a front's default tools: the rest left out)."""
    allowed = who.policy.host_tools
    return list(tools) if allowed is None else [t for t in tools if t in allowed]


def check_limits(who: Principal, asked: dict[str, float]) -> None:
    """`asked`: the limits a request names (unset ones are capped, not refused)."""
    ceilings = who.policy.max_limits or {}
    for name, value in asked.items():
        ceiling = ceilings.get(name)
        if ceiling is not None and value > ceiling:
            raise PolicyDenied.by_rule(
                who.name,
                f"ask for limits.{name}={value:g}",
                "max_limits",
                f"allows at most {name}={ceiling:g}",
                hint="Ask for less, or ask an admin to raise it (code-interpreter keys set-policy)",
            )


def capped_limits(who: Principal, limits: ResourceLimits, asked: Iterable[str]) -> ResourceLimits:
    """`limits` with each limit the request did not name lowered to the policy's ceiling."""
    ceilings = who.policy.max_limits or {}
    named = set(asked)
    lowered = {
        name: type(getattr(limits, name))(ceiling)
        for name, ceiling in ceilings.items()
        if name not in named and getattr(limits, name) > ceiling
    }
    if not lowered:
        return limits
    return ResourceLimits.model_validate({**limits.model_dump(), **lowered})


def check_commands(who: Principal) -> None:
    if not who.policy.commands:
        raise PolicyDenied.by_rule(
            who.name,
            "run shell commands, background processes or terminals",
            "commands",
            f"is off{COMMANDS_SCOPE}",
        )


def check_session_count(who: Principal, held: int) -> None:
    """`held`: the key's sessions running (or being made) now, this one not counted."""
    most = who.policy.max_sessions
    if most is not None and held >= most:
        raise PolicyDenied.by_rule(
            who.name,
            f"hold more than {most} session(s) at once (it holds {held})",
            "max_sessions",
            f"allows {most}",
            hint="End one first, or ask an admin to raise it (code-interpreter keys set-policy)",
        )


def check_request(who: Principal, backend: str, request: CreateSessionRequest) -> None:
    """What a request for a new session names itself, against the key's policy."""
    check_backend(who, backend)
    if request.image is not None:
        check_image(who, request.image)
    if request.network is not None:
        check_network(who, request.network)
    check_tools(who, request.tools)
    if request.volumes:
        writable = any(not v.read_only for v in request.volumes)
        check_volumes(who, mounted=len(request.volumes), writable=writable)
    if request.limits is not None:
        check_limits(who, request.limits.model_dump(exclude_none=True))


def fit_spec(
    who: Principal,
    spec: SandboxSpec,
    request: CreateSessionRequest,
    *,
    images: bool,
    default_image: str,
    offered_images: list[str],
) -> SandboxSpec:
    """The spec a request made, with what it left to the service's defaults fitted within the
    key's policy: limits lowered to its ceilings, the network to the most it allows, the image
    (where its backend runs one: `images`, `BackendCapabilities.images`) to one it allows."""
    asked = request.limits.model_dump(exclude_none=True) if request.limits is not None else {}
    fitted = spec.model_copy(update={"limits": capped_limits(who, spec.limits, asked)})
    if request.network is None:
        fitted.network = capped_network(who, spec.network)
    if request.image is None and images:
        image = _fit_image(who, default_image, offered_images)
        if image is not None:
            fitted.image = image
    return fitted


def fit_resumed(
    who: Principal, backend: str, spec: SandboxSpec, *, images: bool, default_image: str
) -> tuple[SandboxSpec, list[str]]:
    """A paused session's spec under its key's policy as it is now (it may have changed while
    the session slept), and what changed, said to its caller. What cannot change without losing
    its state (its backend, its image) is refused (PolicyDenied: it stays paused); its network
    and limits are lowered within the policy, as a fresh session's would be."""
    check_backend(who, backend)
    if images:  # its backend runs an image (`BackendCapabilities.images`)
        check_image(who, spec.image or default_image)
    notices: list[str] = []
    fitted = spec.model_copy(deep=True)
    most = who.policy.network
    if most is not None and fitted.network.beyond(most) is not None:
        fitted.network = capped_network(who, fitted.network)
        notices.append(
            f"its network is now {fitted.network.describe()!r}: its key's policy (rule `network`) "
            f"allows at most {most.describe()}"
        )
    lowered = capped_limits(who, fitted.limits, ())
    if lowered != fitted.limits:
        changed = ", ".join(
            f"{name}={getattr(lowered, name):g}"
            for name in ResourceLimits.model_fields
            if getattr(lowered, name) != getattr(fitted.limits, name)
        )
        fitted.limits = lowered
        notices.append(f"its limits are now {changed}: its key's policy (rule `max_limits`)")
    if fitted.mounts:  # its volumes: none (refused, it stays paused), or read-only now
        check_volumes(who, mounted=len(fitted.mounts))
        writable = [m.path for m in fitted.mounts if not m.read_only]
        if who.policy.volumes == "read_only" and writable:
            fitted.mounts = [m.model_copy(update={"read_only": True}) for m in fitted.mounts]
            notices.append(
                f"its volumes at {', '.join(writable)} are read-only now: its key's policy "
                "(rule `volumes`)"
            )
    return fitted, notices
