"""Workspace paths as callers give them: split into safe components, or refused with the reason.

Public and pure, so every front door checks a name the same way before any byte moves.
"""

from __future__ import annotations

from code_interpreter_wire.errors import InvalidPath


def clean_path(path: str, *, allow_root: bool = False) -> tuple[str, ...]:
    """Split a workspace-relative path into safe components, or raise InvalidPath."""
    if "\x00" in path:
        raise InvalidPath("the path contains a NUL byte")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise InvalidPath("the path contains a control character")
    if path.startswith("/") or path.startswith("\\"):
        raise InvalidPath(f"{path!r} is absolute: give a path relative to the workspace")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidPath(f"{path!r} contains '..': paths must stay inside the workspace")
    if any(len(p.encode()) > 255 for p in parts):
        raise InvalidPath("a path component is longer than 255 bytes")
    if not parts and not allow_root:
        raise InvalidPath("the path is empty")
    return parts
