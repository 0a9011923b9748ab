"""The rules of a key's policy, as pure logic: what a policy file may say, what each check
refuses (naming the key, the rule and what it allows), and how what a request left unset is
fitted within the policy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from code_interpreter_wire.network_policy import NO_NETWORK, policy_from_text
from code_interpreter_wire.rest import CreateSessionRequest
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from orchestrator.governance import policy_checks as checks
from orchestrator.governance.errors import PolicyDenied
from orchestrator.governance.policy import FULL_ACCESS, MAX_NAMES, Policy, Principal

pytestmark = pytest.mark.unit


def who(**rules: object) -> Principal:
    return Principal(id="p_1", name="analyst", policy=Policy.model_validate(rules))


def denied(rule: str, call: object) -> str:
    assert isinstance(call, PolicyDenied)
    assert call.rule == rule and call.key == "analyst" and call.status == 403
    message = str(call)
    assert message.startswith("key 'analyst' may not ") and f"`{rule}`" in message
    return message


def refusal(fn: object, *args: object) -> PolicyDenied:
    with pytest.raises(PolicyDenied) as caught:
        fn(*args)  # type: ignore[operator]
    return caught.value


def test_a_policy_reads_as_people_write_it_and_refuses_what_is_wrong() -> None:
    policy = Policy.model_validate(
        {"languages": ["js", "Python", "py"], "network": "pypi.org:443", "backends": ["local"]}
    )
    assert policy.languages == ["javascript", "python"]  # canonical, once each
    assert policy.network is not None and policy.network.mode == "allow_list"
    assert policy.describe_rules() == {
        "backends": ["local"],
        "languages": ["javascript", "python"],
        "network": {"mode": "allow_list", "allow": [{"host": "pypi.org", "ports": [443]}]},
    }
    for bad, said in [
        ({"backends": ["dockr"]}, "unknown backend 'dockr'"),
        ({"languages": ["cobol"]}, "cobol"),
        ({"max_limits": {"ram": 1}}, "unknown limit 'ram'"),
        ({"max_limits": {"memory_mb": 8}}, "memory_mb: Input should be greater than or equal"),
        ({"max_sessions": -1}, "greater than or equal to 0"),
        ({"tools": ["x"]}, "Extra inputs are not permitted"),
        ({"host_tools": ["x"] * (MAX_NAMES + 1)}, f"at most {MAX_NAMES} names"),
        ({"images": ["a" * 300]}, "a name must be 1 to 256 characters"),
        ({"images": [" "]}, "a name must be 1 to 256 characters"),
    ]:
        with pytest.raises(ValidationError) as caught:
            Policy.model_validate(bad)
        assert said in str(caught.value), (bad, str(caught.value))


def test_full_access_allows_everything_and_no_check_refuses_it() -> None:
    everyone = Principal(id="k", name="key-k", policy=FULL_ACCESS)
    checks.check_backend(everyone, "docker")
    checks.check_image(everyone, "anything:latest")
    checks.check_language(everyone, "java")
    checks.check_network(everyone, policy_from_text("any"))
    checks.check_tools(everyone, ["a", "b"])
    checks.check_limits(everyone, {"memory_mb": 16384})
    checks.check_commands(everyone)
    checks.check_session_count(everyone, 10_000)
    assert checks.allowed_tools(everyone, ["a", "b"]) == ["a", "b"]
    assert everyone.may_answer("k") and not everyone.may_answer("other")


def test_each_check_names_the_key_the_rule_and_what_it_allows() -> None:
    analyst = who(
        backends=["local"],
        images=["img:1"],
        languages=["python"],
        network="pypi.org:443",
        host_tools=["add"],
        max_limits={"memory_mb": 1024},
        max_sessions=2,
        commands=False,
    )
    message = denied("backends", refusal(checks.check_backend, analyst, "docker"))
    assert "may not use the docker backend" in message and "allows: local" in message
    assert "Ask an admin to change it (code-interpreter keys set-policy)" in message
    assert "allows: img:1" in denied("images", refusal(checks.check_image, analyst, "x:2"))
    assert "run bash code" in denied("languages", refusal(checks.check_language, analyst, "bash"))
    message = denied(
        "network", refusal(checks.check_network, analyst, policy_from_text("example.com:443"))
    )
    assert "pypi.org:443" in message
    checks.check_network(analyst, NO_NETWORK)  # less than the most is fine
    message = denied("host_tools", refusal(checks.check_tools, analyst, ["add", "mail", "pay"]))
    assert "mail, pay" in message and "allows: add" in message
    assert checks.allowed_tools(analyst, ["add", "mail"]) == ["add"]
    message = denied("max_limits", refusal(checks.check_limits, analyst, {"memory_mb": 2048}))
    assert "memory_mb=2048" in message and "at most memory_mb=1024" in message
    checks.check_limits(analyst, {"memory_mb": 1024, "cpus": 4})  # at the ceiling; unbounded
    assert "is off" in denied("commands", refusal(checks.check_commands, analyst))
    checks.check_session_count(analyst, 1)
    message = denied("max_sessions", refusal(checks.check_session_count, analyst, 2))
    assert "holds 2" in message and "End one first" in message


def test_what_a_request_leaves_unset_is_fitted_within_the_policy() -> None:
    analyst = who(
        max_limits={"memory_mb": 1024, "cpus": 0.5},
        network="pypi.org:443",
        images=["code-interpreter-kernel-full:latest"],
    )
    spec = SandboxSpec(limits=ResourceLimits(memory_mb=2048, cpus=1.0, pids=256))
    request = CreateSessionRequest.model_validate({"limits": {"pids": 128}})
    fitted = checks.fit_spec(
        analyst,
        spec,
        request,
        images=True,
        default_image="code-interpreter-kernel:latest",
        offered_images=["code-interpreter-kernel:latest", "code-interpreter-kernel-full:latest"],
    )
    assert fitted.limits.memory_mb == 1024 and fitted.limits.cpus == 0.5
    assert fitted.limits.pids == 256  # the spec's own: what the request named is not touched
    assert fitted.image == "code-interpreter-kernel-full:latest"
    assert fitted.network == NO_NETWORK  # the default (none) is within pypi.org:443
    assert spec.limits.memory_mb == 2048  # the spec given is not changed
    # No allowed image the service offers: refused, saying both lists.
    with pytest.raises(PolicyDenied) as caught:
        checks.fit_spec(
            who(images=["mine:1"]),
            spec,
            CreateSessionRequest(),
            images=True,
            default_image="code-interpreter-kernel:latest",
            offered_images=["code-interpreter-kernel:latest"],
        )
    assert "none of which this service offers" in str(caught.value)
    # The local backend has no image to fit.
    local = checks.fit_spec(
        who(images=["mine:1"]),
        spec,
        CreateSessionRequest(),
        images=False,
        default_image="code-interpreter-kernel:latest",
        offered_images=[],
    )
    assert local.image is None


@pytest.mark.parametrize(
    ("most", "default", "fitted"),
    [
        (None, "any", "any"),
        ("any", "pypi.org:443", "pypi.org:443"),
        ("pypi.org:443", "none", "none"),
        ("pypi.org:443", "any", "pypi.org:443"),  # the policy's own: within the default
        ("none", "pypi.org:443", "none"),
        ("pypi.org:443", "example.com:443", "none"),  # nothing in common
    ],
)
def test_the_network_left_unset_is_the_most_of_the_default_the_policy_allows(
    most: str | None, default: str, fitted: str
) -> None:
    analyst = who() if most is None else who(network=most)
    got = checks.capped_network(analyst, policy_from_text(default))
    assert got == policy_from_text(fitted)
