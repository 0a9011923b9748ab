"""A language the session does not have, told to the model that asked for it: in-process it is
`UnknownLanguage` or `LanguageUnavailable`, over HTTP a 400 of the same names. Either way the
message names the languages there are, so the model can pick one."""

from __future__ import annotations

from code_interpreter_client.http_client import APIError
from code_interpreter_wire.errors import LanguageUnavailable, UnknownLanguage

LANGUAGE_ERRORS = (UnknownLanguage.__name__, LanguageUnavailable.__name__)  # as the API names them


def language_refusal(exc: BaseException) -> str | None:
    """What the model reads when `exc` refused a language; None for any other failure."""
    if isinstance(exc, LanguageUnavailable | UnknownLanguage):
        return str(exc)
    if isinstance(exc, APIError) and exc.kind in LANGUAGE_ERRORS:
        return exc.message
    return None
