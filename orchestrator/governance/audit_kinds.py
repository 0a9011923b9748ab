"""The kinds of audit events: one name each, so that writers and readers (filters, the console,
people's queries) never spell one two ways. What each event's `details` hold is said beside it."""

from __future__ import annotations

SESSION_CREATED = "session.created"  # backend, image, runtime, network mode, tools, snapshot
SESSION_ENDED = "session.ended"  # reason (deleted, idle, lifetime, lost, ...), why (the words)
SESSION_PAUSED = "session.paused"
SESSION_RESUMED = "session.resumed"
EXECUTION = "execution"  # execution_id, language, code (capped), output sizes, images
COMMAND = "command"  # command (capped), exit_code, output sizes
PROCESS_STARTED = "process.started"  # pid, command (capped), terminal
# pid, terminal, text (what was typed or written to stdin), bytes, dropped_bytes/_records (the
# rate's drops before it; alone, status "dropped", in a record of the drops only): input_audit.py
PROCESS_INPUT = "process.input"
TOOL_CALL = "tool.call"  # tool, arguments_sha256, arguments_bytes, approver (helper: approvals)
APPROVAL_REQUESTED = "approval.requested"
APPROVAL_DECIDED = "approval.decided"
FILE_UPLOAD = "file.upload"  # path, bytes
FILE_DOWNLOAD = "file.download"  # path, bytes
FILE_REMOVE = "file.remove"  # path
FILE_MKDIR = "file.mkdir"  # path
EGRESS_CONNECTION = "egress.connection"  # host, port, verdict, reason, bytes up and down
# port, caller (owner, token, public), client address, bytes in and out, why it ended; or status
# "refused" with the reason (no such port open, a cap reached)
PORT_CONNECTION = "port.connection"
VOLUME_CREATED = "volume.created"  # volume_id, name, size_mb
VOLUME_DELETED = "volume.deleted"  # volume_id
VOLUME_MOUNTED = "volume.mounted"  # volume_id, path, read_only (with the session's id)
VOLUME_FILE_WRITE = "volume.file.write"  # volume_id, path, bytes
VOLUME_FILE_REMOVE = "volume.file.remove"  # volume_id, path
VOLUME_FILE_MKDIR = "volume.file.mkdir"  # volume_id, path
KEY_ADDED = "key.added"
KEY_ROTATED = "key.rotated"
KEY_REVOKED = "key.revoked"
KEY_POLICY = "key.policy"
POLICY_DENIED = "policy.denied"  # rule, message
AUDIT_DROPPED = "audit.dropped"  # dropped: events the full queue could not take
# The credential vault (orchestrator/vault/): name, hosts, replaced; name; and one per
# connection that carried placeholders: host, secrets (up to 16 {name, outcome}), more (status
# "substituted" when any was, else "unchanged"). Never a value.
SECRET_STORED = "secret.stored"
SECRET_DELETED = "secret.deleted"
SECRET_USED = "secret.used"

ALL_KINDS = (
    SESSION_CREATED,
    SESSION_ENDED,
    SESSION_PAUSED,
    SESSION_RESUMED,
    EXECUTION,
    COMMAND,
    PROCESS_STARTED,
    PROCESS_INPUT,
    TOOL_CALL,
    APPROVAL_REQUESTED,
    APPROVAL_DECIDED,
    FILE_UPLOAD,
    FILE_DOWNLOAD,
    FILE_REMOVE,
    FILE_MKDIR,
    EGRESS_CONNECTION,
    PORT_CONNECTION,
    VOLUME_CREATED,
    VOLUME_DELETED,
    VOLUME_MOUNTED,
    VOLUME_FILE_WRITE,
    VOLUME_FILE_REMOVE,
    VOLUME_FILE_MKDIR,
    KEY_ADDED,
    KEY_ROTATED,
    KEY_REVOKED,
    KEY_POLICY,
    POLICY_DENIED,
    AUDIT_DROPPED,
    SECRET_STORED,
    SECRET_DELETED,
    SECRET_USED,
)

# The owner of the service's own events (audit.dropped): no key's, so only admins see them.
SERVICE_OWNER = "service"
