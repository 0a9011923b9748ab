"""What the composition root hands the front doors when it builds them: HTTP-level settings that
are no session's decision (sizes, transport timeouts, whether metrics are public, the console's
secret). Fronts read these, never the service's settings: what a session may have is the
service's parts' to decide. A section like the parts' (`FrontConfig.of(settings)`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from orchestrator.settings_sections import Section


class FrontConfig(Section):
    host: str  # where the HTTP server listens (MCP's DNS-rebinding protection on loopback)
    max_request_bytes: int
    mcp_idle_timeout_s: float  # an MCP transport session's idle timeout
    terminal_auth_timeout_s: float  # a browser terminal's wait for its first (key) frame
    http_header_timeout_s: float
    metrics_public: bool
    console_secret: SecretStr | None  # signs console logins; None: one kept under state_dir
    state_dir: Path
    e2b_honor_insecure: bool  # E2B's `secure: false` opens its code port to public traffic
