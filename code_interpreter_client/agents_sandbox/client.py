"""Makes the Agents SDK's sandbox sessions on code-interpreter sessions (embedded, or of a
running service), and finds a session again when a run resumes."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from typing import Any

from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSession, SandboxSessionState
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.sandbox_client import BaseSandboxClient
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot

from code_interpreter_client.agents_sandbox.options import (
    BACKEND_ID,
    CodeInterpreterSandboxClientOptions,
    CodeInterpreterSandboxSessionState,
    check_root,
    check_service_options,
)
from code_interpreter_client.agents_sandbox.session import (
    CodeInterpreterSandboxSession,
    create_remote_session,
)
from code_interpreter_client.code_session import CodeSession, RemoteSession
from code_interpreter_client.http_client import APIError
from code_interpreter_wire.background_loop import run_in_background
from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.spec import SandboxSpec


class CodeInterpreterSandboxClient(BaseSandboxClient[CodeInterpreterSandboxClientOptions | None]):
    """Makes Agents SDK sandbox sessions on code-interpreter sessions.

    `base_url` (and `api_key`): a running service; without it, each sandbox is an embedded
    session of this process (`CodeSession.embedded`, with `spec` and `backend_config`; needs the
    server extra). Close the client (`await client.close()`) to end embedded sessions that a run
    left alive for resuming.
    """

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        spec: SandboxSpec | None = None,
        backend_config: Mapping[str, Any] | None = None,
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        self.base_url = base_url
        self._api_key = api_key  # kept here, never in a session's (serializable) state
        self._spec = spec
        self._backend_config = dict(backend_config or {})
        self._instrumentation = instrumentation or Instrumentation()
        self._dependencies = dependencies
        self._live: dict[str, CodeInterpreterSandboxSession] = {}  # by code session id

    async def _new_code_session(
        self, backend: str | None, network: NetworkPolicy | None = None
    ) -> CodeSession:
        if self.base_url is not None:
            made = await run_in_background(
                create_remote_session(self.base_url, self._api_key, backend, network)
            )
            code: CodeSession = RemoteSession(self.base_url, self._api_key, made, owned=True)
        else:
            spec = self._spec
            if network is not None:
                spec = (spec or SandboxSpec()).model_copy(update={"network": network})
            code = CodeSession.embedded(backend or "local", spec, **self._backend_config)
        try:
            await code.start()
        except BaseException:
            await code.close()
            raise
        return code

    def _session(
        self, state: CodeInterpreterSandboxSessionState, code: CodeSession, *, preserved: bool
    ) -> SandboxSession:
        inner = CodeInterpreterSandboxSession(
            state=state,
            code=code,
            on_shutdown=self._forget,
            base_url=self.base_url,
            api_key=self._api_key,
        )
        inner._set_start_state_preserved(preserved, system=preserved)
        assert code.session_id is not None
        self._live[code.session_id] = inner
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def _forget(self, session: CodeInterpreterSandboxSession) -> None:
        for key, live in list(self._live.items()):
            if live is session:
                del self._live[key]

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: CodeInterpreterSandboxClientOptions | None = None,
    ) -> SandboxSession:
        options = options or CodeInterpreterSandboxClientOptions()
        manifest = self._validate_manifest_for_create(manifest or Manifest())
        check_root(manifest)
        check_service_options(
            self.base_url is None, options.pause_on_exit, options.workspace_persistence
        )
        code = await self._new_code_session(options.backend, options.network)
        session_id = uuid.uuid4()
        state = CodeInterpreterSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            backend=options.backend,
            network=options.network,
            code_session_id=code.session_id,
            pause_on_exit=options.pause_on_exit,
            workspace_persistence=options.workspace_persistence,
            workspace_root_ready=True,  # /workspace exists in every sandbox
        )
        return self._session(state, code, preserved=False)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, CodeInterpreterSandboxSession):
            raise TypeError("CodeInterpreterSandboxClient.delete expects one of its own sessions")
        if await inner.running():
            await inner.shutdown()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """The session the state names, if this client (embedded) or the service (remote)
        still has it, woken if it was paused: its workspace and variables are as they were.
        Else a new one, which the SDK then hydrates from the state's snapshot."""
        if not isinstance(state, CodeInterpreterSandboxSessionState):
            raise TypeError("CodeInterpreterSandboxClient.resume expects its own session state")
        state.assert_path_grants_rebound()
        check_root(state.manifest)
        check_service_options(
            self.base_url is None, state.pause_on_exit, state.workspace_persistence
        )
        code = await self._reattach(state.code_session_id)
        if code is not None:
            return self._session(state, code, preserved=True)
        code = await self._new_code_session(state.backend, state.network)
        state.code_session_id = code.session_id
        state.workspace_root_ready = False  # a new sandbox: nothing of the old one is in it
        return self._session(state, code, preserved=False)

    async def _reattach(self, code_session_id: str | None) -> CodeSession | None:
        if code_session_id is None:
            return None
        if self.base_url is None:
            live = self._live.pop(code_session_id, None)
            return live.code_session if live is not None and await live.running() else None
        code = RemoteSession(self.base_url, self._api_key, code_session_id, owned=True)
        try:
            await code.start()
            if (await code.state()).state == "paused":
                await code.resume()  # now, so the SDK's first look finds it running
        except BaseException as exc:
            # Not reattached: the session is left to the service as it is (a paused one whose
            # resume failed keeps its saved state, to be tried again), never ended from here.
            code.disown()
            with contextlib.suppress(Exception):
                await code.close()
            if isinstance(exc, APIError) and exc.status in (404, 410):
                return None
            raise
        return code

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, CodeInterpreterSandboxSessionState)

    async def close(self) -> None:
        """End every session this client still holds (those a run left alive for resuming)."""
        sessions, self._live = list(self._live.values()), {}
        for session in sessions:
            with contextlib.suppress(Exception):
                await session.shutdown()
