"""The daemonless gVisor backend: runsc driven directly, so whole sandboxes checkpoint."""
