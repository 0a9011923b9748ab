"""The service's parts, each one idea; `orchestrator.service.Service` builds and wires them, and
fronts call them through it (`service.lifecycle.create(...)`, `service.runs.execute(...)`).

- admission: keys' policies, caps, a new session's spec and network, time limits, approvals.
- lifecycle: sessions made, found (woken if paused), listed, paused, resumed, ended;
  pausing (save and restore) and sweeps (expiry, shutdown, retention) beside it.
- runs: code, commands, processes. workspace: files and kept outputs.
- channels: host tools and egress proxies. persistence: the store and snapshots.
- audit_trail: the audit log's events. views: the answers' shapes. errors: the refusals.
"""
