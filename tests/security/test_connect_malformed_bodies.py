"""Bodies that do not decode, sent to every Connect route of the E2B front by the sandbox's own
owner (valid sandbox id and token): garbage protobuf bytes and malformed JSON, as unary bodies
and inside streaming envelopes. Each is the caller's mistake, answered with Connect's
`invalid_argument` (E2B's SDK: `InvalidArgumentException`), never `unknown`/500, and the server
goes on serving everyone."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import httpx
import pytest

from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

UNARY = {
    "filesystem.Filesystem": (
        "Stat",
        "MakeDir",
        "Move",
        "ListDir",
        "Remove",
        "CreateWatcher",
        "GetWatcherEvents",
        "RemoveWatcher",
    ),
    "process.Process": ("List", "Update", "SendInput", "SendSignal", "CloseStdin"),
}
STREAMING = {"filesystem.Filesystem": ("WatchDir",), "process.Process": ("Connect", "Start")}
CLIENT_STREAMING = {"process.Process": ("StreamInput",)}


def _routes(methods: Mapping[str, tuple[str, ...]]) -> list[str]:
    return [
        f"{prefix}/{service}/{method}"
        for prefix in ("", "/e2b")
        for service, names in methods.items()
        for method in names
    ]


# Bytes no protobuf message decodes from, whatever its fields: a tag whose varint never ends, a
# field claiming 4 GiB that is not there, groups (of field 16, whose tag bytes are not brackets the
# gate's JSON depth check would catch first) nested past the parser's depth limit.
GARBAGE_PROTO = {
    "endless-varint": b"\xff" * 10 + b"\x01",
    "truncated-field": b"\x0a\xff\xff\xff\xff\x0f",
    "deep-groups": b"\x83\x01" * 1000 + b"\x84\x01" * 1000,
}
# JSON no request message decodes from: not JSON, or not an object.
BAD_JSON = {"not-json": b"{not json", "string": b'"text"', "array": b"[]"}


@dataclass
class Target:
    server: Server
    owner: dict[str, str]  # the E2B sandbox's id and access token
    session_id: str  # a /v1 session of KEY_A that must keep working

    def alive(self) -> None:
        """The process is up, a bystander session computes, the sandbox still serves its owner."""
        assert self.server.process is not None
        assert self.server.process.poll() is None, self.server.log.read_text()[-3000:]
        with self.server.client() as api:
            r = api.post(f"/v1/sessions/{self.session_id}/execute", json={"code": "1 + 1"})
            assert r.status_code == 200 and r.json()["results"][0]["text"] == "2", r.text
        listed = _post(
            self,
            "/filesystem.Filesystem/ListDir",
            b'{"path": "/workspace", "depth": 1}',
            "application/json",
        )
        assert listed.status_code == 200, listed.text


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    srv = make_server().start()
    with srv.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        made = api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": KEY_A})
        assert made.status_code == 201, made.text
    owner = {
        "E2b-Sandbox-Id": made.json()["sandboxID"],
        "X-Access-Token": made.json()["envdAccessToken"],
    }
    yield Target(srv, owner, sid)
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def _post(target: Target, path: str, body: bytes, content_type: str) -> httpx.Response:
    headers = {**target.owner, "content-type": content_type}
    return httpx.post(target.server.url + path, content=body, headers=headers, timeout=60)


def _envelope(message: bytes) -> bytes:
    """One Connect streaming envelope: flags 0, big-endian length, the message."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def _end_stream_error(body: bytes) -> dict[str, str]:
    """The error of a Connect stream's last envelope (flag 0x02: end of stream)."""
    envelopes = []
    while body:
        flags, length = body[0], struct.unpack(">I", body[1:5])[0]
        envelopes.append((flags, body[5 : 5 + length]))
        body = body[5 + length :]
    flags, last = envelopes[-1]
    assert flags & 0x02, f"the stream did not end with its end-of-stream message: {envelopes}"
    error: dict[str, str] = json.loads(last)["error"]
    return error


def _bodies() -> list[tuple[str, str, bytes]]:
    return [("proto", name, body) for name, body in GARBAGE_PROTO.items()] + [
        ("json", name, body) for name, body in BAD_JSON.items()
    ]


BODY_IDS = [f"{codec}-{name}" for codec, name, _ in _bodies()]


@pytest.mark.parametrize(("codec", "name", "body"), _bodies(), ids=BODY_IDS)
@pytest.mark.parametrize("path", _routes(UNARY))
def test_a_unary_call_that_does_not_decode_is_invalid_argument(
    target: Target, path: str, codec: str, name: str, body: bytes
) -> None:
    refused = _post(target, path, body, f"application/{codec}")
    assert refused.status_code == 400, refused.text
    assert refused.json()["code"] == "invalid_argument", refused.text
    assert "not a valid" in refused.json()["message"]


@pytest.mark.parametrize(("codec", "name", "body"), _bodies(), ids=BODY_IDS)
@pytest.mark.parametrize("path", _routes(STREAMING) + _routes(CLIENT_STREAMING))
def test_a_stream_whose_message_does_not_decode_ends_invalid_argument(
    target: Target, path: str, codec: str, name: str, body: bytes
) -> None:
    """A Connect stream always answers HTTP 200 (its protocol); its end-of-stream message
    carries the error, which is what E2B's SDK reads."""
    refused = _post(target, path, _envelope(body), f"application/connect+{codec}")
    assert refused.status_code == 200, refused.text
    error = _end_stream_error(refused.content)
    assert error["code"] == "invalid_argument", error
    assert "not a valid" in error["message"]


@pytest.mark.parametrize("content_type", ["application/grpc", "application/grpc+proto"])
@pytest.mark.parametrize("path", ["/filesystem.Filesystem/ListDir", "/e2b/process.Process/Start"])
def test_grpc_which_this_server_cannot_answer_is_refused_saying_so(
    target: Target, path: str, content_type: str
) -> None:
    """gRPC ends its answers with HTTP trailers, which this server does not send: it was a 500
    `unknown` (connectrpc raised); now a 415 saying what to use."""
    refused = _post(target, path, _envelope(GARBAGE_PROTO["endless-varint"]), content_type)
    assert refused.status_code == 415, refused.text
    assert refused.json()["code"] == "unimplemented"
    assert "Connect protocol" in refused.json()["message"]
    target.alive()


def test_the_service_goes_on_after_malformed_bodies(target: Target) -> None:
    for path in _routes(UNARY)[:3]:
        for body in GARBAGE_PROTO.values():
            _post(target, path, body, "application/proto")
    target.alive()
