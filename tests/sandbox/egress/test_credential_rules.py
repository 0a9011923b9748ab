"""The rules a credential binding adds to where a value may go: the headers it names, a cap on
the swaps per request (and the head size they make), the methods never given a value, path
prefixes matched by whole segments, one-label wildcards, bounded outcomes, and no pickling."""

from __future__ import annotations

import copy
import pickle

import pytest

from code_interpreter_wire.network_policy import HostPattern
from sandbox.egress.credentials import (
    DEFAULT_SECRET_HEADERS,
    HEAD_TOO_LARGE,
    HEADER_NOT_BOUND,
    MAX_HEADER_NAME_CHARS,
    MAX_OUTCOMES,
    MAX_SECRET_HEADERS,
    MAX_SWAPS,
    MAX_SWAPS_PER_NAME,
    METHOD_NOT_BOUND,
    NOT_LISTED,
    PATH_NOT_BOUND,
    SUBSTITUTED,
    TOO_MANY_PLACEHOLDERS,
    UNKNOWN_NAME,
    CredentialBinding,
    CredentialBindings,
    HeadTooLarge,
    SecretValue,
)

VALUE = "sk-real-0123456789abcdef"


def _one(
    methods: tuple[str, ...] | None = None, path_prefixes: tuple[str, ...] | None = None
) -> CredentialBindings:
    binding = CredentialBinding(
        "KEY", VALUE, hosts=("api.test",), methods=methods, path_prefixes=path_prefixes
    )
    return CredentialBindings([binding])


# ---- 1. the headers a value may go in ---------------------------------------------------------


def test_by_default_a_value_goes_in_authorization_x_api_key_and_api_key_only() -> None:
    binding = CredentialBinding("KEY", VALUE, hosts=("api.test",))
    assert binding.headers == DEFAULT_SECRET_HEADERS == ("authorization", "x-api-key", "api-key")
    echoed = ("idempotency-key", "x-request-id", "origin", "content-type", "cookie", "x-custom")
    headers = [(name.encode(), b"cir-secret://KEY") for name in (*DEFAULT_SECRET_HEADERS, *echoed)]
    done = CredentialBindings([binding]).substitute(
        headers, host="api.test", method="POST", path="/"
    )
    assert done.headers[:3] == [(name.encode(), VALUE.encode()) for name in DEFAULT_SECRET_HEADERS]
    assert done.headers[3:] == headers[3:]
    assert done.outcomes == (("KEY", SUBSTITUTED), ("KEY", HEADER_NOT_BOUND))


def test_named_headers_any_case_replace_the_defaults() -> None:
    binding = CredentialBinding(
        "KEY", VALUE, hosts=("api.test",), headers=["X-Custom-Auth", "Cookie", "x-custom-auth"]
    )
    assert binding.headers == ("x-custom-auth", "cookie")
    secrets = CredentialBindings([binding])
    headers = [
        (b"x-custom-auth", b"cir-secret://KEY"),
        (b"cookie", b"session=cir-secret://KEY"),
        (b"authorization", b"Bearer cir-secret://KEY"),
    ]
    done = secrets.substitute(headers, host="api.test", method="GET", path="/")
    assert done.headers == [
        (b"x-custom-auth", VALUE.encode()),
        (b"cookie", f"session={VALUE}".encode()),
        (b"authorization", b"Bearer cir-secret://KEY"),
    ]
    assert done.outcomes == (("KEY", SUBSTITUTED), ("KEY", HEADER_NOT_BOUND))


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ([], "at least one header"),
        (["x bad"], "not a header name"),
        (["x:y"], "not a header name"),
        ([""], "not a header name"),
        (["x\r\nEvil"], "not a header name"),
        (["x" * (MAX_HEADER_NAME_CHARS + 1)], "at most 64 characters"),
        ([f"x-{i}" for i in range(MAX_SECRET_HEADERS + 1)], "at most 16 headers"),
        (["Host"], "frames the request"),
        (["Content-Length"], "frames the request"),
        (["transfer-encoding"], "frames the request"),
        (["Connection"], "frames the request"),
        (["Proxy-Authorization"], "concerns one hop"),
        (["TE"], "concerns one hop"),
        (["Upgrade"], "concerns one hop"),
    ],
)
def test_header_names_are_checked(headers: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        CredentialBinding("KEY", VALUE, hosts=("api.test",), headers=headers)
    assert VALUE not in str(caught.value)


def test_a_bare_string_is_one_header_name() -> None:
    binding = CredentialBinding("KEY", VALUE, hosts=("api.test",), headers="X-Token")
    assert binding.headers == ("x-token",)
    most = [f"x-{i}" for i in range(MAX_SECRET_HEADERS)]
    assert CredentialBinding("KEY", VALUE, hosts=("a.test",), headers=most).headers == tuple(most)


# ---- 2. swaps per request, and the head size they make -----------------------------------------


def test_at_most_four_swaps_of_one_name_and_sixteen_in_all() -> None:
    names = [f"K{i}" for i in range(6)]
    secrets = CredentialBindings(
        [CredentialBinding(name, f"v-{name}", hosts=("api.test",)) for name in names]
    )
    many = ",".join(["cir-secret://K0"] * 10).encode()
    done = secrets.substitute([(b"authorization", many)], host="api.test", method="GET", path="/")
    assert done.swaps == MAX_SWAPS_PER_NAME == 4
    assert done.headers[0][1] == b",".join([b"v-K0"] * 4 + [b"cir-secret://K0"] * 6)
    assert done.outcomes == (("K0", SUBSTITUTED), ("K0", TOO_MANY_PLACEHOLDERS))
    spread = [(b"x-api-key", ",".join(f"cir-secret://{n}" for n in names * 4).encode())]
    done = secrets.substitute(spread, host="api.test", method="GET", path="/")
    assert done.swaps == MAX_SWAPS == 16
    value = done.headers[0][1].split(b",")
    assert value[:16] == [f"v-{n}".encode() for n in names * 3][:16]
    assert value[16:] == [f"cir-secret://{n}".encode() for n in (names * 4)[16:]]
    assert ("K4", TOO_MANY_PLACEHOLDERS) in done.outcomes


def test_a_head_the_values_would_make_too_large_is_refused_before_any_copy() -> None:
    big = "v" * 4000
    secrets = CredentialBindings([CredentialBinding("KEY", big, hosts=("api.test",))])
    headers = [(b"authorization", b",".join([b"cir-secret://KEY"] * 4))]
    done = secrets.substitute(
        headers, host="api.test", method="GET", path="/", max_head_bytes=17000
    )
    assert done.swaps == 4
    with pytest.raises(HeadTooLarge) as caught:
        secrets.substitute(
            headers,
            host="api.test",
            method="GET",
            path="/",
            max_head_bytes=16000,
            request_line_bytes=20,
        )
    assert caught.value.limit == 16000 and caught.value.size > 16000
    assert caught.value.outcomes == (("KEY", HEAD_TOO_LARGE),)
    assert big not in str(caught.value) and "16000" in str(caught.value)
    # Nothing swapped: no limit concerns it.
    unbound = [(b"x-other", b",".join([b"cir-secret://KEY"] * 4))]
    secrets.substitute(unbound, host="api.test", method="GET", path="/", max_head_bytes=100)


# ---- 3. methods never given a value ----------------------------------------------------------


@pytest.mark.parametrize("method", ["TRACE", "trace", "TRACK", "CONNECT"])
def test_trace_track_and_connect_never_get_a_value(method: str) -> None:
    for methods in (None, ("GET", "TRACE", "TRACK", "CONNECT")):
        secrets = _one(methods=methods)
        headers = [(b"authorization", b"cir-secret://KEY")]
        done = secrets.substitute(headers, host="api.test", method=method, path="/")
        assert done.headers == headers and done.outcomes == (("KEY", METHOD_NOT_BOUND),)


# ---- 4. path prefixes by whole segments ------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "path", "bound"),
    [
        ("/v1", "/v1", True),
        ("/v1", "/v1/models", True),
        ("/v1", "/v1?x=1", True),
        ("/v1", "/v1-admin", False),
        ("/v1", "/v10/models", False),
        ("/v1/", "/v1/models", True),
        ("/v1/", "/v1", False),
        ("/v1/", "/v1-admin", False),
        ("/v1", "/v1/..;/admin", False),
        ("/v1", "/v1;a=b/models", False),
        ("/v1", "/v1//admin", False),
        ("/v1/", "/v1//admin", False),
        ("/v1", "/v1/%252e%252e/admin", False),
        ("/v1", "/v1/%3b/admin", False),
        ("/v1", "/v1/%2e%2e/admin", False),
        ("/v1", "/v1/..\\admin", False),
        ("/v1", "/v1/./models", False),
    ],
)
def test_path_prefixes_match_whole_segments_and_tricky_paths_never(
    prefix: str, path: str, bound: bool
) -> None:
    secrets = _one(path_prefixes=(prefix,))
    headers = [(b"authorization", b"cir-secret://KEY")]
    done = secrets.substitute(headers, host="api.test", method="GET", path=path)
    assert done.outcomes == (("KEY", SUBSTITUTED if bound else PATH_NOT_BOUND),)


# ---- 5. a binding's wildcard is one label ------------------------------------------------------


def test_a_bindings_wildcard_matches_exactly_one_label() -> None:
    secrets = CredentialBindings([CredentialBinding("KEY", VALUE, hosts=("*.example.test",))])
    assert secrets.binds("a.example.test") and secrets.binds("A.Example.Test.")
    assert not secrets.binds("a.b.example.test")
    assert not secrets.binds("example.test") and not secrets.binds("aexample.test")
    headers = [(b"authorization", b"cir-secret://KEY")]
    deep = secrets.substitute(headers, host="a.b.example.test", method="GET", path="/")
    assert deep.headers == headers
    # The network policy's own wildcard is left as it was: any depth.
    assert HostPattern.parse("*.example.test").matches("a.b.example.test")


# ---- 6. outcomes bounded ----------------------------------------------------------------------


def test_outcomes_are_at_most_sixteen_the_rest_summed_up() -> None:
    names = [f"K{i}" for i in range(20)]
    secrets = CredentialBindings(
        [CredentialBinding(name, VALUE, hosts=("other.test",)) for name in names]
    )
    value = ",".join(f"cir-secret://{n}" for n in [*names, "FAKE_1", "FAKE_2"]).encode()
    done = secrets.substitute([(b"authorization", value)], host="api.test", method="GET", path="/")
    assert len(done.outcomes) == MAX_OUTCOMES
    assert done.outcomes[-2] == ("<6 more names>", NOT_LISTED)
    assert done.outcomes[-1] == ("<2 unknown names>", UNKNOWN_NAME)


# ---- 7. reprs and pickling -------------------------------------------------------------------


def test_no_value_in_a_repr_and_nothing_pickles() -> None:
    binding = CredentialBinding("KEY", VALUE, hosts=("api.test",), headers=["X-Token"])
    secrets = CredentialBindings([binding])
    done = secrets.substitute(
        [(b"x-token", b"cir-secret://KEY")], host="api.test", method="GET", path="/"
    )
    assert done.headers == [(b"x-token", VALUE.encode())]
    for text in (repr(binding), repr(done), str(done), repr(secrets)):
        assert VALUE not in text
    assert "x-token" in repr(binding) and "headers" not in repr(done)
    for thing in (binding.value, binding, secrets):
        with pytest.raises(TypeError, match="not pickled") as caught:
            pickle.dumps(thing)
        assert VALUE not in str(caught.value)
    # Copies stay in the process, and are the same value.
    assert copy.deepcopy(binding.value) is binding.value and copy.copy(binding) == binding
    assert SecretValue(VALUE) == binding.value
