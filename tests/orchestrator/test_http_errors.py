"""The HTTP status of each typed error of the sandbox layer, and invalid input told in one line."""

from __future__ import annotations

import inspect

import pytest
from pydantic import BaseModel, ValidationError

import code_interpreter_wire.errors
from code_interpreter_wire.errors import (
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)
from orchestrator.http_errors import STATUS_OF_ERROR, problems, status_of

pytestmark = pytest.mark.unit

SANDBOX_ERRORS = [
    kind
    for _, kind in inspect.getmembers(code_interpreter_wire.errors, inspect.isclass)
    if issubclass(kind, SandboxError) and kind.__module__ == code_interpreter_wire.errors.__name__
]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidPath("'..' climbs out"), 400),
        (FileMissing("no such file"), 404),
        (FileAccessError("a symlink"), 403),
        (FileTooLarge("too big"), 413),
        (SandboxClosed("closed"), 410),
        (BackendRateLimited("slow down"), 429),
        (BackendTimeout("no answer"), 504),
        (BackendUnavailable("no engine"), 503),
        (SandboxStartError("kernel failed"), 503),
        (SandboxError("anything else"), 500),
    ],
)
def test_each_typed_error_has_its_status(error: Exception, status: int) -> None:
    assert status_of(error) == status


def test_a_missing_file_is_not_found_although_it_is_an_access_error() -> None:
    assert issubclass(FileMissing, FileAccessError)
    assert status_of(FileMissing("x")) == 404


def test_every_error_the_sandbox_layer_defines_has_a_status_of_its_own() -> None:
    """Listed by name: a new error would otherwise pass as its base's status (often 500)."""
    assert SANDBOX_ERRORS, "code_interpreter_wire.errors defines no errors?"
    listed = {kind for kind, _ in STATUS_OF_ERROR}
    missing = [kind.__name__ for kind in SANDBOX_ERRORS if kind not in listed]
    assert not missing, f"no status listed for {missing}"


def test_no_entry_is_hidden_behind_a_more_general_one_before_it() -> None:
    """The first match wins, so a subclass listed after its base would never be reached."""
    for i, (later, _) in enumerate(STATUS_OF_ERROR):
        for earlier, _ in STATUS_OF_ERROR[:i]:
            assert not issubclass(later, earlier), f"{later.__name__} after {earlier.__name__}"


class AFutureSandboxError(SandboxError):
    pass


def test_an_unlisted_sandbox_error_is_a_server_fault() -> None:
    assert status_of(AFutureSandboxError("x")) == 500


@pytest.mark.parametrize("error", [KeyError("k"), ValueError("v"), RuntimeError("r"), Exception()])
def test_errors_that_are_not_ours_have_no_status(error: Exception) -> None:
    """A KeyError is a bug somewhere, never a polite 404."""
    assert status_of(error) is None
    assert status_of(error, {KeyError: 404, ValueError: 400}) is None


def test_an_override_changes_only_the_kind_it_names() -> None:
    overrides: dict[type[Exception], int] = {FileAccessError: 400, SandboxClosed: 502}
    assert status_of(FileAccessError("x"), overrides) == 400
    assert status_of(SandboxClosed("x"), overrides) == 502
    # The entry that matched is what is looked up: a subclass with its own entry keeps it.
    assert status_of(FileMissing("x"), overrides) == 404
    assert status_of(FileTooLarge("x"), overrides) == 413


def test_an_override_for_a_base_applies_to_subclasses_without_their_own_entry() -> None:
    assert status_of(AFutureSandboxError("x"), {SandboxError: 503}) == 503


def test_the_table_is_not_changed_by_overrides() -> None:
    before = list(STATUS_OF_ERROR)
    status_of(FileAccessError("x"), {FileAccessError: 400})
    assert before == STATUS_OF_ERROR
    assert status_of(FileAccessError("x")) == 403


class Body(BaseModel):
    code: str
    limits: dict[str, int] = {}


def test_problems_joins_each_location_and_message() -> None:
    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"limits": {"memory_mb": "lots"}})
    assert problems(caught.value.errors()) == (
        "code: Field required; "
        "limits.memory_mb: Input should be a valid integer, unable to parse string as an integer"
    )


def test_problems_names_an_error_of_the_whole_body() -> None:
    errors = [{"loc": (), "msg": "Input should be an object"}]
    assert problems(errors, whole="body") == "body: Input should be an object"
    assert problems(errors) == ": Input should be an object"


def test_problems_of_fastapi_locations_include_numbers() -> None:
    errors = [
        {"loc": ("body", "files", 2, "path"), "msg": "String should have at least 1 character"}
    ]
    assert problems(errors) == "body.files.2.path: String should have at least 1 character"


def test_no_problems_is_an_empty_line() -> None:
    assert problems([]) == ""
