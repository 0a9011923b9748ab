"""The service's own limit on open files: each HTTP connection holds one descriptor and each
egress connection two, and the soft limit is often far below the hard one (1024 under
systemd), so the service lifts it to the hard one before it serves."""

from __future__ import annotations

import contextlib
import resource


def raise_descriptor_limit() -> int:
    """Lift the soft limit on open files to the hard one and return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
