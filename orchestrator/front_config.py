"""What the composition root hands the front doors when it builds them: HTTP-level settings that
are no session's decision (sizes, transport timeouts, whether metrics are public, the console's
secret). Fronts read these, never the service's settings: what a session may have is the
service's parts' to decide."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from orchestrator.config import Settings


@dataclass(frozen=True)
class FrontConfig:
    host: str  # where the HTTP server listens (MCP's DNS-rebinding protection on loopback)
    max_request_bytes: int
    mcp_idle_timeout_s: float  # an MCP transport session's idle timeout
    terminal_auth_timeout_s: float  # a browser terminal's wait for its first (key) frame
    http_header_timeout_s: float
    metrics_public: bool
    console_secret: SecretStr | None  # signs console logins; None: one kept under state_dir
    state_dir: Path

    @classmethod
    def of(cls, settings: Settings) -> FrontConfig:
        return cls(
            host=settings.host,
            max_request_bytes=settings.max_request_bytes,
            mcp_idle_timeout_s=settings.mcp_idle_timeout_s,
            terminal_auth_timeout_s=settings.terminal_auth_timeout_s,
            http_header_timeout_s=settings.http_header_timeout_s,
            metrics_public=settings.metrics_public,
            console_secret=settings.console_secret,
            state_dir=settings.state_dir,
        )
