"""A model's raw tool-call arguments: read when usable, else explained so it can fix its call."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from code_interpreter_wire.tool_arguments import (
    ToolArguments,
    ToolCallError,
    explain_invalid,
    parse_arguments,
)

pytestmark = pytest.mark.unit

EXAMPLE = '{"code": "print(1 + 1)"}'
SESSION_HINT = 'Add "session_id" to continue a session.'


def refusal(raw: Any, *, bound_session: bool = False) -> str:
    with pytest.raises(ToolCallError) as caught:
        parse_arguments(raw, bound_session=bound_session)
    return str(caught.value)


@pytest.mark.parametrize(
    "raw",
    [
        '{"code": "print(1)"}',
        {"code": "print(1)"},
        '  {"code": "print(1)"}\n',
    ],
)
def test_a_json_string_or_an_object_is_read(raw: Any) -> None:
    assert parse_arguments(raw) == ToolArguments(code="print(1)", session_id=None)


def test_the_session_id_is_kept() -> None:
    args = parse_arguments('{"code": "x = 1", "session_id": "s-42"}')
    assert (args.code, args.session_id) == ("x = 1", "s-42")


def test_extra_fields_are_ignored_not_refused() -> None:
    args = parse_arguments({"code": "1", "dialect": "python", "timeout": [1, 2]})
    assert args.code == "1"
    assert not hasattr(args, "dialect")


def test_code_is_taken_verbatim() -> None:
    code = 'print("a\\tb")\n\n  # trailing\n'
    assert parse_arguments({"code": code}).code == code


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ("{", "line 1, column 2"),
        ('{"code": "a",\n}', "line 2, column 1"),
        ("{'code': 'print(1)'}", "line 1, column 2"),  # Python quotes, not JSON's
    ],
)
def test_invalid_json_says_where_and_how_to_quote(raw: str, where: str) -> None:
    message = refusal(raw)
    assert message.startswith("The arguments are not valid JSON (")
    assert where in message
    assert EXAMPLE in message
    assert "escape its quotes and newlines" in message


@pytest.mark.parametrize(
    ("raw", "kind"),
    [("[1, 2]", "list"), ("42", "int"), ('"print(1)"', "str"), ([], "list"), (7, "int")],
)
def test_anything_but_an_object_is_refused_by_its_type(raw: Any, kind: str) -> None:
    assert refusal(raw) == f"The arguments must be a JSON object such as {EXAMPLE}, not {kind}."


@pytest.mark.parametrize("raw", ["", "   \n", {}])
def test_no_arguments_at_all_says_code_is_missing(raw: Any) -> None:
    assert "'code' is missing" in refusal(raw)


def test_empty_code_is_named_empty() -> None:
    message = refusal({"code": ""})
    assert "'code' is empty" in message
    assert "missing" not in message


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ({"code": 5}, "'code' input should be a valid string"),
        ({"code": None}, "'code' input should be a valid string"),
        ({"code": ["print(1)"]}, "'code' input should be a valid string"),
        ({"code": "1", "session_id": 3}, "'session_id' input should be a valid string"),
    ],
)
def test_a_wrong_type_names_the_field(raw: Any, problem: str) -> None:
    message = refusal(raw)
    assert message.startswith("The arguments are not usable: ")
    assert problem in message
    assert EXAMPLE in message


def test_every_problem_is_listed_at_once() -> None:
    message = refusal({"session_id": 3})
    assert "'code' is missing; 'session_id' input should be a valid string" in message


def test_the_session_hint_is_only_for_a_model_that_passes_session_ids() -> None:
    assert refusal({}).endswith(SESSION_HINT)
    bound = refusal({}, bound_session=True)
    assert "session_id" not in bound
    assert bound.endswith(f"Send a JSON object such as {EXAMPLE}.")


def test_a_json_parse_error_never_mentions_sessions() -> None:
    assert "session" not in refusal("{")


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000,
        '{"code": ' + "[" * 100_000,
        '{"a": ' * 100_000,
        "9" * 5000,  # past Python's limit on digits in an int
        '{"code": "1", "session_id": ' + "9" * 5000 + "}",
    ],
    ids=["array-nesting", "nesting-in-code", "object-nesting", "long-int", "long-int-field"],
)
def test_json_the_parser_cannot_take_is_explained_not_crashing(raw: str) -> None:
    """A model (or a caller) can send any text. JSON nested past the parser's recursion limit, or
    an integer past Python's digit limit, must come back as a ToolCallError like any other
    malformed call, not as RecursionError or ValueError (a 500 on the invoke route, an exception
    out of the OpenAI Agents adapter)."""
    message = refusal(raw)
    assert EXAMPLE in message


def test_explain_invalid_on_its_own() -> None:
    with pytest.raises(ValidationError) as caught:
        ToolArguments.model_validate({"code": "", "session_id": 1.5})
    assert explain_invalid(caught.value) == (
        "The arguments are not usable: 'code' is empty; 'session_id' input should be a valid "
        'string. Send a JSON object such as {"code": "print(1 + 1)"}.'
    )


def test_explain_invalid_names_the_whole_when_there_is_no_location() -> None:
    with pytest.raises(ValidationError) as caught:
        ToolArguments.model_validate("not a dict")
    assert "'arguments' " in explain_invalid(caught.value)
