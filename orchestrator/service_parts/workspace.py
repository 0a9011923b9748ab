"""The workspace: a session's files (upload, download, list, remove, make a directory) and the
outputs the service keeps of its executions (their JSON and their images)."""

from __future__ import annotations

import posixpath

from code_interpreter_wire.results import Execution, FileInfo
from orchestrator.governance import audit_kinds as audited
from orchestrator.outputs import KeptBytes, KeptImage, KeptOutputs
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.sessions import Session
from orchestrator.settings_sections import AdmissionSection

_PLACEHOLDER = ".cir-make-dir"


class Workspace:
    def __init__(
        self,
        settings: AdmissionSection,
        admission: Admission,
        trail: AuditTrail,
        outputs: KeptOutputs,
    ) -> None:
        self._max_download_bytes = settings.max_download_bytes
        self._admission = admission
        self._trail = trail
        self._outputs = outputs

    # --- the workspace's files
    async def upload(self, session: Session, path: str, data: bytes) -> FileInfo:
        self._admission.check_upload_size(len(data))
        async with session.activity():
            info = await session.sandbox.upload(path, data)
        self._trail.file(audited.FILE_UPLOAD, session, path, len(data))
        return info

    async def download(self, session: Session, path: str) -> bytes:
        async with session.activity():
            data = await session.sandbox.download(path, max_bytes=self._max_download_bytes)
        self._trail.file(audited.FILE_DOWNLOAD, session, path, len(data))
        return data

    async def list_files(
        self, session: Session, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        async with session.activity():
            return await session.sandbox.list_files(path, recursive=recursive)

    async def file_info(self, session: Session, path: str) -> FileInfo | None:
        """What is at `path` (a workspace-relative path, not the root), or None."""
        parent = posixpath.dirname(path)
        for info in await self.list_files(session, parent):
            if info.path == path:
                return info
        return None

    async def remove_file(self, session: Session, path: str) -> None:
        async with session.activity():
            await session.sandbox.remove_file(path)
        self._trail.file(audited.FILE_REMOVE, session, path)

    async def make_directory(self, session: Session, path: str) -> None:
        """Make a directory (and its parents) in the workspace."""
        # The sandbox interface makes directories as a file's parents: write one, remove it.
        placeholder = posixpath.join(path, _PLACEHOLDER)
        async with session.activity():
            await session.sandbox.upload(placeholder, b"")
            await session.sandbox.remove_file(placeholder)
        self._trail.file(audited.FILE_MKDIR, session, path)

    # --- kept outputs
    async def open_kept_execution(self, session: Session, execution_id: str) -> KeptBytes:
        return await self.kept_output(session.id, execution_id)

    async def kept_execution(self, session: Session, execution_id: str) -> Execution:
        await self._outputs.settled(session.id, execution_id)
        return await self._outputs.execution(session.id, execution_id)

    async def artifact(self, session: Session, artifact_id: str) -> KeptImage:
        """An image an execution produced."""
        return await self.kept_artifact(session.id, artifact_id)

    async def kept_output(self, session_id: str, execution_id: str) -> KeptBytes:
        """A kept execution's JSON by session id, running or paused: for a reader that has
        checked whose session it is (the console), without waking it."""
        await self._outputs.settled(session_id, execution_id)
        return await self._outputs.open_execution(session_id, execution_id)

    async def kept_artifact(self, session_id: str, artifact_id: str) -> KeptImage:
        """`artifact`, by session id (as `kept_output`)."""
        await self._outputs.settled(session_id, artifact_id)
        return await self._outputs.artifact(session_id, artifact_id)
