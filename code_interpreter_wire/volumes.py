"""Volumes on the wire: directories that outlive sessions, owned by a key, mounted into sessions
(docs/volumes.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from code_interpreter_wire.spec import check_mount_path

# A volume's id as the service makes them; anything else names no volume.
VOLUME_ID_PATTERN = r"^vol-[0-9a-f]{24}$"
VolumeId = Annotated[str, StringConstraints(pattern=VOLUME_ID_PATTERN)]
VolumeName = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]


class CreateVolumeRequest(BaseModel):
    name: VolumeName = Field(description="A name of your choosing (not unique).")
    size_mb: int | None = Field(
        None,
        ge=1,
        description="Its size: what its files may hold together. The service's default if "
        "unset; above the service's largest is refused (400).",
    )


class VolumeInfo(BaseModel):
    id: str
    name: str
    created_at: datetime
    size_mb: int = Field(description="What its files may hold together.")
    used_bytes: int = Field(description="What they hold now.")
    mounted_by: list[str] = Field(
        default_factory=list, description="The sessions (running or paused) that mount it."
    )


class VolumeMount(BaseModel):
    """A volume in a new session (`POST /v1/sessions {"volumes": [...]}`)."""

    volume_id: VolumeId
    path: Annotated[str, AfterValidator(check_mount_path)] = Field(
        description="Where the session sees it: below /mnt or /data (e.g. /mnt/data)."
    )
    read_only: bool = False
