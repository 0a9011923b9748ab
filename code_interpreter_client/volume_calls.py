"""The HTTP client's calls on volumes (docs/volumes.md): `AsyncClient` and `Client` have them."""

from __future__ import annotations

from typing import Any

from code_interpreter_client.http_answers import HttpCalls
from code_interpreter_client.http_answers import checked as _check
from code_interpreter_client.http_answers import file_path as _path
from code_interpreter_client.http_answers import segment as _segment
from code_interpreter_wire.background_loop import run_sync
from code_interpreter_wire.results import FileInfo
from code_interpreter_wire.volumes import VolumeInfo


class VolumeCalls(HttpCalls):
    """Volumes and their files; sessions mount them with `volumes=[{volume_id, path}]`."""

    async def create_volume(self, name: str, size_mb: int | None = None) -> VolumeInfo:
        body: dict[str, Any] = {"name": name}
        if size_mb is not None:
            body["size_mb"] = size_mb
        return VolumeInfo.model_validate(await self._json("POST", "/v1/volumes", json=body))

    async def list_volumes(self) -> list[VolumeInfo]:
        return [VolumeInfo.model_validate(v) for v in await self._json("GET", "/v1/volumes")]

    async def get_volume(self, volume_id: str) -> VolumeInfo:
        url = f"/v1/volumes/{_segment(volume_id)}"
        return VolumeInfo.model_validate(await self._json("GET", url))

    async def delete_volume(self, volume_id: str) -> None:
        _check(await self.http.delete(f"/v1/volumes/{_segment(volume_id)}"))

    async def upload_to_volume(self, volume_id: str, path: str, data: bytes) -> FileInfo:
        response = await self.http.post(
            f"/v1/volumes/{_segment(volume_id)}/files",
            params={"path": path},
            files={"file": (path.rsplit("/", 1)[-1], data)},
        )
        return FileInfo.model_validate(_check(response).json())

    async def list_volume_files(
        self, volume_id: str, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        data = await self._json(
            "GET",
            f"/v1/volumes/{_segment(volume_id)}/files",
            params={"path": path, "recursive": recursive},
        )
        return [FileInfo.model_validate(f) for f in data]

    async def download_from_volume(self, volume_id: str, path: str) -> bytes:
        url = f"/v1/volumes/{_segment(volume_id)}/files/{_path(path)}"
        return _check(await self.http.get(url)).content

    async def delete_from_volume(self, volume_id: str, path: str) -> None:
        url = f"/v1/volumes/{_segment(volume_id)}/files/{_path(path)}"
        _check(await self.http.delete(url))

    async def make_volume_directory(self, volume_id: str, path: str) -> None:
        url = f"/v1/volumes/{_segment(volume_id)}/directories"
        _check(await self.http.post(url, params={"path": path}))


class BlockingVolumeCalls:
    """`VolumeCalls`, blocking."""

    api: VolumeCalls

    def create_volume(self, name: str, size_mb: int | None = None) -> VolumeInfo:
        return run_sync(self.api.create_volume(name, size_mb))

    def list_volumes(self) -> list[VolumeInfo]:
        return run_sync(self.api.list_volumes())

    def get_volume(self, volume_id: str) -> VolumeInfo:
        return run_sync(self.api.get_volume(volume_id))

    def delete_volume(self, volume_id: str) -> None:
        run_sync(self.api.delete_volume(volume_id))

    def upload_to_volume(self, volume_id: str, path: str, data: bytes) -> FileInfo:
        return run_sync(self.api.upload_to_volume(volume_id, path, data))

    def list_volume_files(
        self, volume_id: str, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        return run_sync(self.api.list_volume_files(volume_id, path, recursive=recursive))

    def download_from_volume(self, volume_id: str, path: str) -> bytes:
        return run_sync(self.api.download_from_volume(volume_id, path))

    def delete_from_volume(self, volume_id: str, path: str) -> None:
        run_sync(self.api.delete_from_volume(volume_id, path))

    def make_volume_directory(self, volume_id: str, path: str) -> None:
        run_sync(self.api.make_volume_directory(volume_id, path))
