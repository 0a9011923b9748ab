"""Whether the ray backend can run here, asked without importing Ray (it may be absent)."""

from __future__ import annotations

import importlib.util
from typing import Any


def why_unavailable(**config: Any) -> str | None:
    """What this machine lacks for the ray backend: Ray itself (the `cluster` extra)."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: `pip install 'code-interpreter-runtime[cluster]'`"
    return None
