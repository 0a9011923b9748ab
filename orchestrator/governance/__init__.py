"""Who may do what (keys as principals with policies), humans who approve risky calls, and a
durable record of everything that ran (docs/governance.md). The service enforces all of it, once,
behind every front door; the records sit behind the small async interfaces of
`stores/`."""
