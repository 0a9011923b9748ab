"""Where executions' full outputs and images are kept, so a trimmed tool output can link to them.

Per session, on disk: `<dir>/<session>/<execution id>.json` (the whole Execution) and
`<dir>/<session>/<artifact id>.<ext>` (each image). They go with the session.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shutil
from pathlib import Path

from sandbox.models import Execution

_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TYPES = {"png": "image/png", "jpg": "image/jpeg", "svg": "image/svg+xml"}


class OutputStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        # Sessions do not outlive the service, so neither do their outputs.
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)

    def _dir(self, session_id: str) -> Path:
        if not _ID.match(session_id):
            raise KeyError(session_id)
        return self.root / session_id

    async def save(self, session_id: str, execution: Execution) -> str:
        """Keep an execution and its images; return the execution's id."""
        execution_id = f"e-{secrets.token_hex(8)}"
        await asyncio.to_thread(self._save, session_id, execution_id, execution)
        return execution_id

    def _save(self, session_id: str, execution_id: str, execution: Execution) -> None:
        d = self._dir(session_id)
        d.mkdir(exist_ok=True)
        (d / f"{execution_id}.json").write_text(execution.model_dump_json())
        for artifact in execution.artifacts:
            path = d / f"{artifact.id}.{artifact.extension}"
            if not path.exists():
                path.write_bytes(artifact.data)

    def execution(self, session_id: str, execution_id: str) -> Execution:
        if not _ID.match(execution_id):
            raise KeyError(execution_id)
        path = self._dir(session_id) / f"{execution_id}.json"
        try:
            return Execution.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise KeyError(execution_id) from None

    def artifact(self, session_id: str, artifact_id: str) -> tuple[Path, str]:
        if not _ID.match(artifact_id):
            raise KeyError(artifact_id)
        for ext, mime in _TYPES.items():
            path = self._dir(session_id) / f"{artifact_id}.{ext}"
            if path.is_file():
                return path, mime
        raise KeyError(artifact_id)

    def drop(self, session_id: str) -> None:
        shutil.rmtree(self._dir(session_id), ignore_errors=True)
