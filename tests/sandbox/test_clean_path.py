"""Workspace paths split into components that cannot leave the workspace, or refused saying why."""

from __future__ import annotations

import re

import pytest

from code_interpreter_wire.errors import InvalidPath
from sandbox.workspace_files import clean_path

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("a.csv", ("a.csv",)),
        ("data/in/a.csv", ("data", "in", "a.csv")),
        ("./a//b/./c/", ("a", "b", "c")),
        ("...", ("...",)),  # a name, not a climb
        ("..a/b..", ("..a", "b..")),
        ("a\\b", ("a\\b",)),  # a backslash is part of a name on POSIX
        ("ünïcødé/名前", ("ünïcødé", "名前")),
        ("x" * 255, ("x" * 255,)),
        ("~", ("~",)),
    ],
)
def test_usable_paths_are_split_into_components(path: str, parts: tuple[str, ...]) -> None:
    assert clean_path(path) == parts


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("..", "contains '..'"),
        ("../etc/passwd", "contains '..'"),
        ("a/../../b", "contains '..'"),
        ("a/..", "contains '..'"),
        ("a/b/../c", "contains '..'"),  # even one that would stay inside
        ("/etc/passwd", "is absolute"),
        ("/", "is absolute"),
        ("//a", "is absolute"),
        ("\\windows\\path", "is absolute"),
        ("a\x00b", "NUL byte"),
        ("\x00", "NUL byte"),
        ("a\nb", "control character"),
        ("a\tb", "control character"),
        ("a\x1bb", "control character"),
        ("a\x7fb", "control character"),
        ("", "the path is empty"),
        (".", "the path is empty"),
        ("./", "the path is empty"),
        ("././.", "the path is empty"),
        ("x" * 256, "longer than 255 bytes"),
        ("é" * 128, "longer than 255 bytes"),  # 256 bytes in UTF-8, 128 characters
        ("ok/" + "x" * 256 + "/ok", "longer than 255 bytes"),
    ],
)
def test_unsafe_paths_are_refused_saying_why(path: str, why: str) -> None:
    with pytest.raises(InvalidPath, match=re.escape(why)):
        clean_path(path)


def test_an_absolute_path_says_to_give_a_relative_one() -> None:
    with pytest.raises(InvalidPath, match="give a path relative to the workspace"):
        clean_path("/workspace/a")


def test_the_root_is_allowed_only_when_asked_for() -> None:
    for root in ("", ".", "./", "./."):
        assert clean_path(root, allow_root=True) == ()
    with pytest.raises(InvalidPath):
        clean_path("/", allow_root=True)  # absolute is never the root
    with pytest.raises(InvalidPath):
        clean_path("..", allow_root=True)


def test_a_nul_byte_is_refused_before_anything_else() -> None:
    with pytest.raises(InvalidPath, match="NUL byte"):
        clean_path("/../\x00")


def test_invalid_path_is_a_value_error_for_callers_that_treat_it_as_bad_input() -> None:
    with pytest.raises(ValueError):
        clean_path("..")
