"""E2B's absolute sandbox paths and our workspace-relative ones: /workspace and below map, the rest
is refused, never silently moved."""

from __future__ import annotations

import re

import pytest

from code_interpreter_wire.errors import InvalidPath
from orchestrator.e2b_compatible.paths import to_sandbox, to_workspace
from sandbox.backends.base import WORKSPACE_IN_SANDBOX

pytestmark = pytest.mark.unit


def test_the_workspace_is_where_the_code_sees_it() -> None:
    assert WORKSPACE_IN_SANDBOX == "/workspace"


@pytest.mark.parametrize(
    ("path", "relative"),
    [
        ("/workspace", ""),
        ("/workspace/", ""),
        ("/workspace/.", ""),
        ("/workspace/a.csv", "a.csv"),
        ("/workspace//data/./a.csv", "data/a.csv"),
        ("/workspace/data/../a.csv", "a.csv"),  # normalised first, and still inside
        ("/workspace/data/", "data"),
        ("a.csv", "a.csv"),
        ("data/a.csv", "data/a.csv"),
        ("./data//a.csv", "data/a.csv"),
        ("", ""),
        (".", ""),
        ("/home/user/a.csv", "a.csv"),  # E2B's home is the sandbox user's workspace
        ("/home/user", ""),
        ("~/data/a.csv", "data/a.csv"),
    ],
)
def test_paths_inside_the_workspace_map_to_it(path: str, relative: str) -> None:
    assert to_workspace(path) == relative


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/etc/passwd",
        "/workspacex/a.csv",  # a sibling whose name starts the same
        "/workspace-other",
        "/workspace/..",
        "/workspace/../etc/passwd",
        "/workspace/a/../../etc",
        "//workspace/a",  # POSIX keeps a leading double slash as another root
    ],
)
def test_absolute_paths_outside_the_workspace_are_refused_saying_where_files_are(
    path: str,
) -> None:
    with pytest.raises(InvalidPath, match=re.escape("is outside /workspace")) as caught:
        to_workspace(path)
    assert "give a path relative to it or under it" in str(caught.value)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../a", "contains '..'"),
        ("data/../../a", "contains '..'"),
        ("/workspace/a\x00b", "NUL byte"),
        ("a\nb", "control character"),
        ("/workspace/" + "x" * 256, "longer than 255 bytes"),
    ],
)
def test_unsafe_relative_paths_are_refused_by_the_workspace_rules(path: str, why: str) -> None:
    with pytest.raises(InvalidPath, match=re.escape(why)):
        to_workspace(path)


@pytest.mark.parametrize(
    ("relative", "absolute"),
    [("", "/workspace"), ("a.csv", "/workspace/a.csv"), ("d/e/f.txt", "/workspace/d/e/f.txt")],
)
def test_to_sandbox_is_the_path_the_code_sees(relative: str, absolute: str) -> None:
    assert to_sandbox(relative) == absolute
    assert to_workspace(to_sandbox(relative)) == relative
