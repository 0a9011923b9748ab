"""Builds the sandbox images: a registry-free Debian base and the data-analysis kernel image."""
