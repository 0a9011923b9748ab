"""E2B's API on this service's sandboxes, so code written for the unmodified E2B SDK runs here.

See docs/e2b.md for what works. `mount` adds it to the app, at the root paths E2B's SDK calls and
again under `/e2b`; `running` is it while the service runs.
"""

from orchestrator.e2b_compatible.front import PREFIX, mount, running

__all__ = ["PREFIX", "mount", "running"]
