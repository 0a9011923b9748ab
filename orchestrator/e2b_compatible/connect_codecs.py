"""Connect's codecs with a bad request body said as one: a body that does not decode (garbage
protobuf bytes, malformed JSON, a field of the wrong type) answers Connect's `invalid_argument`,
which E2B's SDK raises as `InvalidArgumentException`. connectrpc lets any decoding error through
as `unknown` (HTTP 500), which reads as the service failing, not the caller's mistake."""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError

# What the protobuf runtime raises for bytes or JSON it cannot read: a truncated or invalid
# varint, bad UTF-8 or JSON (ValueError), a value of the wrong type (TypeError), a number out of
# its field's range (OverflowError), groups nested past its depth limit (RecursionError).
_UNDECODABLE = (ValueError, TypeError, ArithmeticError, RecursionError)
_MAX_DETAIL = 200  # characters of the parser's own message kept in the answer


class RefusingCodec:
    """A codec whose decoding errors are the caller's (`invalid_argument`), never the server's."""

    def __init__(self, codec: Codec[Any, Any]) -> None:
        self._codec = codec

    def name(self) -> str:
        return self._codec.name()

    def encode(self, message: Any) -> bytes:
        return self._codec.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._codec.decode(data, message_class)
        except _UNDECODABLE as exc:
            detail = str(exc)[:_MAX_DETAIL]
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"the request body is not a valid {self.name()} {message_class.__name__} "
                f"message: {detail}",
            ) from None


def refusing_codecs() -> list[Codec[Any, Any]]:
    """Connect's own two codecs (binary protobuf, JSON), each refusing what it cannot decode."""
    return [RefusingCodec(proto_binary_codec()), RefusingCodec(proto_json_codec())]
