"""The front door of sessions' inbound ports (docs/ports.md): HTTP and WebSocket carried to a
server in a sandbox, by path (`/v1/sessions/{id}/ports/{port}/...`) or by host
(`<port>-<id>.<domain>`). It parses and relays; who may, how much and the log are the
service's (orchestrator/service_parts/ports.py)."""
