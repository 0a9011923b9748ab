"""A process's own limit on open files: each HTTP connection the service holds takes one
descriptor and each egress connection two, and the soft limit is often far below the hard one
(1024 under systemd), so whoever serves them (the service, a session actor running a proxy)
lifts it to the hard one first."""

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
