"""The workspace as the Agents SDK persists it: a tar of its files (checked before anything is
unpacked), or in "snapshot" mode a reference to a service snapshot; and the fingerprint that
tells whether a resumed workspace still matches it."""

from __future__ import annotations

import io
import json
from pathlib import Path, PurePosixPath

from agents.sandbox.errors import WorkspaceArchiveWriteError
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes
from agents.sandbox.workspace_paths import sandbox_path_str

from code_interpreter_client.agents_sandbox.options import WORKSPACE

# A snapshot's tar while it is made or unpacked: in the workspace, where the files API reaches.
SNAPSHOT_FILE = ".cir-agents-snapshot-{}.tar"
# Where the workspace's own times are kept while that tar comes and goes (outside the workspace).
TIMES_FILE = "/tmp/.cir-agents-workspace-times-{}"
# What `persist_workspace` returns in "snapshot" mode: this line, then {"snapshot_id": ...}.
NATIVE_SNAPSHOT_MAGIC = b"CODE_INTERPRETER_SNAPSHOT_V1\n"
# The SDK's fingerprint hashes a tar of the workspace, times and all. A paused session's files
# come back with new times (the service writes them afresh), so ours hashes what a workspace
# holds: paths, types, modes, link targets and contents, in name order, times and owners
# left out. A workspace the service brought back unchanged then needs no restore; one that
# lost something (a mode, a link) does not match, and is restored from the snapshot.
FINGERPRINT_VERSION = "code_interpreter_content_sha256_v1"
FINGERPRINT_SCRIPT = r"""
root=$1; out=$2; digest=$3; st=$out.status.$$; shift 3
mkdir -p -- "$(dirname -- "$out")" || exit 1
h=$( { tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --no-wildcards "$@" \
  -C "$root" -cf - .; echo $? > "$st"; } | sha256sum | cut -d' ' -f1 )
s=$(cat "$st"); rm -f -- "$st"; [ "$s" -le 1 ] || exit "$s"
fp=$(printf '%s\n%s\n' "$h" "$digest" | sha256sum | cut -d' ' -f1)
payload=$(printf '{"fingerprint":"%s","version":"%s"}' "$fp" "$VERSION")
printf '%s' "$payload" > "$out.tmp.$$" && mv -f -- "$out.tmp.$$" "$out" && printf '%s' "$payload"
"""


def native_snapshot_ref(data: bytes) -> str | None:
    """The service snapshot id a "snapshot"-mode archive names, or None for a tar."""
    if not data.startswith(NATIVE_SNAPSHOT_MAGIC):
        return None
    try:
        ref = json.loads(data[len(NATIVE_SNAPSHOT_MAGIC) :])
    except ValueError:
        return None
    snapshot_id = ref.get("snapshot_id") if isinstance(ref, dict) else None
    return snapshot_id if isinstance(snapshot_id, str) and snapshot_id else None


def read_bytes(data: io.IOBase) -> bytes:
    raw = data.read()
    return raw.encode() if isinstance(raw, str) else bytes(raw)


def validate_tar(raw: bytes) -> None:
    """Refuse an archive with a member that would land outside the workspace (`..`, an
    absolute path, a link out of it), before anything of the workspace is touched."""
    try:
        validate_tar_bytes(raw, allow_external_symlink_targets=False)
    except UnsafeTarMemberError as exc:
        context = {"reason": exc.reason, "member": exc.member}
        raise WorkspaceArchiveWriteError(path=Path(WORKSPACE), context=context, cause=exc) from exc


def workspace_relative(path: Path) -> str | None:
    """The path inside the workspace ("" for its root), or None when it is elsewhere."""
    posix = PurePosixPath(sandbox_path_str(path))
    try:
        relative = posix.relative_to(WORKSPACE).as_posix()
    except ValueError:
        return None
    return "" if relative == "." else relative
