"""The HTTP API's request and response bodies. Executions travel as
`code_interpreter_wire.results.Execution`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Base64Bytes,
    BaseModel,
    Field,
    StringConstraints,
    create_model,
    model_validator,
)

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from code_interpreter_wire.languages import LANGUAGES, MAX_LANGUAGE_NAME, PYTHON
from code_interpreter_wire.network_policy import NO_NETWORK, NetworkPolicy
from code_interpreter_wire.ports import PortsInfo, PortsRequest
from code_interpreter_wire.results import Execution
from code_interpreter_wire.secrets import MAX_SECRETS_PER_SESSION, SecretName
from code_interpreter_wire.spec import MAX_MOUNTS, ResourceLimits, mounts_apart
from code_interpreter_wire.tool_definitions import ToolFormat
from code_interpreter_wire.volumes import VolumeMount


def _encodable(text: str) -> str:
    """JSON may spell a lone surrogate (`"\\udc80"`), which no UTF-8 text can hold: refused here
    with where it is, rather than failing later on its way to the kernel."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
            "which is not valid Unicode text; send well-formed UTF-8"
        ) from None
    return text


# Every string that reaches a kernel (code, environment, working directory): valid Unicode.
KernelText = Annotated[str, AfterValidator(_encodable)]
# An environment variable's name as shells and os.environ accept it; values hold no NUL.
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")]
EnvValue = Annotated[KernelText, StringConstraints(pattern=r"^[^\x00]*$", max_length=65536)]
Env = dict[EnvName, EnvValue]


def _limits_request() -> type[BaseModel]:
    """Every field of ResourceLimits, optional: what a session may ask to change."""
    fields: dict[str, Any] = {}
    for name, info in ResourceLimits.model_fields.items():
        annotation: Any = info.annotation
        fields[name] = (annotation | None, Field(None, description=info.description))
    return create_model(
        "LimitsRequest",
        __doc__="Limits to change from the service's defaults; each within the service's "
        "ceiling (see ResourceLimits).",
        **fields,
    )


if TYPE_CHECKING:

    class LimitsRequest(BaseModel):
        """Typed as a plain model: its fields are ResourceLimits', each optional."""

else:
    LimitsRequest = _limits_request()


class InitialFile(BaseModel):
    path: str
    content_base64: Base64Bytes


class CreateSessionRequest(BaseModel):
    backend: str | None = Field(
        None, description="local or docker; the service's default if unset."
    )
    image: str | None = Field(None, description="Kernel image (docker).")
    runtime: str | None = Field(
        None,
        max_length=64,
        description="The OCI runtime of its containers (docker): `runsc` for gVisor, `runc`; "
        "the service's default if unset; one the operator does not allow is refused (400).",
    )
    limits: LimitsRequest | None = None
    network: NetworkPolicy | None = Field(
        None,
        description="What its code may reach: 'none', 'any', a list of allowed hosts "
        "(`pypi.org:443`, `*.pythonhosted.org`), or {allow, deny}; the service's default if "
        "unset. Above the operator's ceiling is refused (400). Traffic goes through a proxy at "
        "127.0.0.1:3128 in the sandbox (docs/network.md).",
    )
    env: Env = Field(default_factory=dict)
    files: list[InitialFile] = Field(default_factory=list, description="Written before any code.")
    tools: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Host tools the session's code may call (`import host_tools`); each must be "
        "registered with the service. None by default: no channel to the host at all.",
    )
    snapshot_id: str | None = Field(
        None,
        max_length=64,
        description="Start from this snapshot of yours: its variables and files (and, unless "
        "given here, its backend and limits).",
    )
    volumes: Annotated[list[VolumeMount], AfterValidator(mounts_apart)] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="Your volumes to mount, each at a path of its own, read-only or not "
        "(docs/volumes.md).",
    )
    ports: PortsRequest | None = Field(
        None,
        description="Reach the servers its code starts (inbound ports): through the service at "
        "/v1/sessions/{id}/ports/{port}/ (HTTP and WebSocket), with its owner's key or its "
        "port token, or by anyone with `public`. None (the default): no inbound traffic.",
    )
    secrets: list[SecretName] = Field(
        default_factory=list,
        max_length=MAX_SECRETS_PER_SESSION,
        description="Names of your stored secrets (POST /v1/secrets) its code may use: each "
        "becomes an environment variable holding the placeholder `cir-secret://NAME`, which "
        "its egress proxy replaces with the value in request headers to the secret's hosts "
        "(its network policy must allow them). The value never enters the sandbox "
        "(docs/secrets.md).",
    )


class SessionInfo(BaseModel):
    id: str
    backend: str
    limits: ResourceLimits
    created_at: datetime
    idle_expires_in_s: float
    lifetime_expires_in_s: float
    busy: bool
    calls_in_progress: int = Field(
        0,
        description="Calls on it in progress now (executions, commands, file transfers). "
        "Executions in one language run one at a time: those sent while one runs wait, and "
        "run in the order they came.",
    )
    executions: int
    from_pool: bool
    runtime: str | None = Field(
        None,
        description="What runs it: the OCI runtime of its containers (docker), the accelerator "
        "of its virtual machine (microvm: `kvm`, or `tcg`, QEMU's emulated CPU); null on "
        "other backends.",
    )
    tools: list[str] = Field(default_factory=list, description="Host tools its code may call.")
    network: NetworkPolicy = Field(
        NO_NETWORK, description="What its code may reach, through its egress proxy."
    )
    languages: list[str] = Field(
        default_factory=lambda: [PYTHON],
        description="The languages its code may be written in (Python first): the `language` "
        "of an execution.",
    )
    started_languages: list[str] = Field(
        default_factory=lambda: [PYTHON],
        description="Those whose kernel has started: each other language's starts on first use.",
    )
    state: Literal["running", "paused"] = Field(
        "running",
        description="`paused`: its variables and files are saved and it holds no process; the "
        "next call (or POST .../resume) resumes it.",
    )
    paused_at: datetime | None = None
    deleted_in_s: float | None = Field(
        None, description="A paused session is deleted for good this long from now."
    )
    ports: PortsInfo | None = Field(
        None, description="How its inbound ports are reached; null: it asked for none."
    )
    secrets: list[str] = Field(
        default_factory=list,
        description="The names of the secrets its egress proxy substitutes (never values).",
    )


class SnapshotRequest(BaseModel):
    name: str | None = Field(None, max_length=200, description="A name of your choosing.")


class SnapshotInfo(BaseModel):
    """A named snapshot: a session's variables and files, to start new sessions from."""

    id: str
    name: str | None
    session_id: str = Field(description="The session it was taken of.")
    backend: str
    created_at: datetime
    bytes: int
    variables: int = Field(description="Variables saved.")
    not_saved: dict[str, str] = Field(
        default_factory=dict, description="Variables that could not be saved, with why."
    )
    files: int
    whole_sandbox: bool = Field(
        False,
        description="The whole sandbox was saved (every kernel's memory, the processes "
        "running, the files): sessions started from it carry all of it on.",
    )


class ResumeInfo(BaseModel):
    """What a resume brought back."""

    session: SessionInfo
    notice: str | None = Field(None, description="What was restored, and what was not.")


# A language as a request names it: canonical or an alias (`js`, `R`...), checked by the service.
LanguageName = Annotated[
    str,
    Field(
        max_length=MAX_LANGUAGE_NAME,
        description=f"The kernel's language: {', '.join(LANGUAGES)} or an alias (js, ts, sh); "
        "Python if unset. Each language has its own kernel and variables; all share the "
        "workspace.",
        examples=["python", "r"],
    ),
]


class EgressConnection(BaseModel):
    """One connection through a session's egress proxy, allowed or refused."""

    time: datetime
    method: str = Field(description="CONNECT (a tunnel, e.g. for HTTPS) or the HTTP method.")
    host: str
    port: int
    allowed: bool
    reason: str
    address: str | None = Field(None, description="The address dialled.")
    bytes_up: int = Field(description="Bytes sent to the destination.")
    bytes_down: int = Field(description="Bytes received from it.")
    duration_s: float


class NetworkReport(BaseModel):
    """A session's network policy and what went through its proxy (the latest connections)."""

    policy: NetworkPolicy
    ceiling: NetworkPolicy = Field(description="The deployment's: every connection passes both.")
    connections_allowed: int = 0
    connections_refused: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    max_bytes: int = Field(description="The session's cap on bytes both ways.")
    connections: list[EgressConnection] = Field(
        default_factory=list, description="The latest connections, oldest first."
    )


class ExecuteRequest(BaseModel):
    code: KernelText
    timeout_s: float | None = Field(None, gt=0)
    env: Env | None = None
    cwd: KernelText | None = None
    language: LanguageName | None = None


class RestartRequest(BaseModel):
    language: LanguageName | None = Field(
        None, description="The kernel to restart; every kernel started if unset."
    )


class LanguagesResponse(BaseModel):
    """What this deployment runs: the languages of each backend's new sessions."""

    default_backend: str
    languages: list[str] = Field(description="The default backend's, Python first.")
    backends: dict[str, list[str]]
    aliases: dict[str, list[str]] = Field(description="Other names each language answers to.")


class ExecutionRecord(Execution):
    """An Execution with where it is kept: its full output stays downloadable by these ids."""

    session_id: str
    execution_id: str
    language: str = Field(PYTHON, description="The language it ran in (its canonical name).")
    approvals: list[ApprovalOutcome] = Field(
        default_factory=list,
        description="What waited for a human's approval (the execution itself, its host tool "
        "calls) and what was decided.",
    )


class InvokeRequest(BaseModel):
    arguments: Any = Field(description="The model's raw tool-call arguments: JSON text or object.")
    format: ToolFormat = ToolFormat.OPENAI_CHAT
    call_id: str | None = Field(None, description="The tool call's id, echoed in the output.")
    inline_images: bool = Field(
        True,
        description="Images as base64 in the output (what model APIs take). False links to the "
        "stored artifact instead: those URLs need this service's bearer key, so only a host "
        "that fetches and forwards images itself should use them.",
    )

    @model_validator(mode="after")
    def _needs_call_id(self) -> InvokeRequest:
        if self.format is not ToolFormat.MCP and not self.call_id:
            raise ValueError(
                f"call_id is required for format {self.format}: pass the id of the model's "
                "tool call, which the tool output must echo"
            )
        return self


class InvokeResponse(BaseModel):
    session_id: str | None
    execution_id: str | None
    status: str  # an ExecutionStatus, or "invalid_call"
    output: dict[str, Any]
    extra_messages: list[dict[str, Any]] = Field(default_factory=list)


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody
