"""E2B's code contexts: `/contexts` create, list, restart, remove.

The default context is the sandbox's own kernel (id `default`). A context made here is, honestly,
a new session of the same backend: a kernel of its own, so its variables are separate, as in E2B;
unlike E2B, it also has a workspace of its own, so files written in one context are not seen by
another. Its `cwd`, if given, is the working directory of every execution in it. Contexts count
towards the key's session limit and end with their sandbox.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response
from pydantic import BaseModel

from orchestrator.e2b_compatible.deps import E2BDep, ReachedDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.execute import DEFAULT_CONTEXT, check_language, context_session
from orchestrator.e2b_compatible.sandboxes import SandboxGone
from orchestrator.schemas import CreateSessionRequest
from sandbox.backends.base import WORKSPACE_IN_SANDBOX

router = APIRouter(route_class=E2BRoute, tags=["e2b"])
MAX_CONTEXTS = 8  # beside the default one, per sandbox


class CreateContext(BaseModel):
    language: str | None = None
    cwd: str | None = None


class ContextInfo(BaseModel):
    id: str
    language: str = "python"
    cwd: str


@router.post("/contexts", summary="E2B: create a code context (a kernel in a new session)")
async def create_context(
    reached: ReachedDep,
    service: ServiceDep,
    sandboxes: E2BDep,
    body: Annotated[CreateContext, Body()] = CreateContext(),  # noqa: B008 - a constant default
) -> ContextInfo:
    check_language(body.language)
    record, session = reached.record, reached.session
    if len(record.contexts) >= MAX_CONTEXTS:
        raise E2BError(429, f"a sandbox holds at most {MAX_CONTEXTS} contexts; remove one first")
    spec = CreateSessionRequest(backend=session.backend, image=session.image)
    new = await service.create_session(record.owner, spec)
    # Checked again after the wait: the sandbox may have ended, or other contexts filled it.
    if not sandboxes.is_live(record) or len(record.contexts) >= MAX_CONTEXTS:
        await service.end_session(new.id, record.owner)
        if not sandboxes.is_live(record):
            raise SandboxGone(record.sandbox_id)
        raise E2BError(429, f"a sandbox holds at most {MAX_CONTEXTS} contexts; remove one first")
    context = sandboxes.add_context(record, new, body.cwd)
    return ContextInfo(id=context.id, cwd=body.cwd or WORKSPACE_IN_SANDBOX)


@router.get("/contexts", summary="E2B: list the code contexts")
async def list_contexts(reached: ReachedDep) -> list[ContextInfo]:
    contexts = [ContextInfo(id=DEFAULT_CONTEXT, cwd=WORKSPACE_IN_SANDBOX)]
    contexts += [
        ContextInfo(id=c.id, cwd=c.cwd or WORKSPACE_IN_SANDBOX)
        for c in reached.record.contexts.values()
    ]
    return contexts


@router.post("/contexts/{context_id}/restart", summary="E2B: restart a context's kernel")
async def restart_context(context_id: str, reached: ReachedDep, service: ServiceDep) -> Response:
    session, _ = await context_session(service, reached.record, reached.session, context_id)
    await service.restart(session)
    return Response(status_code=204)


@router.delete("/contexts/{context_id}", summary="E2B: remove a context")
async def remove_context(context_id: str, reached: ReachedDep, sandboxes: E2BDep) -> Response:
    if context_id in (DEFAULT_CONTEXT, reached.record.sandbox_id):
        raise E2BError(400, "the default context cannot be removed; kill the sandbox instead")
    context = reached.record.contexts.get(context_id)
    if context is None:
        raise E2BError(404, f"context {context_id} not found")
    await sandboxes.remove_context(reached.record, context)
    return Response(status_code=204)
