"""Sandbox backends: each hands out sandboxes that run code in isolation."""
