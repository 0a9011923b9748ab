"""E2B's code contexts: `/contexts` create, list, restart, remove.

Every sandbox has a default context per language it can run (E2B's server starts Python's and
JavaScript's, and one for any other language on first use): each is that language's kernel in
the sandbox's own session, listed with a stable UUID (and Python's also answering to `default`,
as in E2B). A context made here is, honestly, a new session of the same backend running the
context's language: a kernel of its own, so its variables are separate, as in E2B; unlike E2B, it
also has a workspace of its own, so files written in one context are not seen by another. Its
`cwd`, if given, is the working directory of every execution in it. Every context's working
directory reads E2B's `/home/user`, which in our sandboxes is the workspace. Contexts count
towards the key's session limit and end with their sandbox.
"""

from __future__ import annotations

import posixpath
from typing import Annotated

from fastapi import APIRouter, Body, Response
from pydantic import BaseModel, StringConstraints

from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.rest import CreateSessionRequest, KernelText
from orchestrator.e2b_compatible.deps import E2BDep, PortReachedDep, ServiceDep
from orchestrator.e2b_compatible.errors import E2BError, E2BRoute
from orchestrator.e2b_compatible.execute import context_target
from orchestrator.e2b_compatible.sandboxes import DEFAULT_CONTEXT, E2B_HOME, SandboxGone
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.languages import check_available

router = APIRouter(route_class=E2BRoute, tags=["e2b"])
MAX_CONTEXTS = 8  # beside the default ones, per sandbox


class CreateContext(BaseModel):
    language: str | None = None
    cwd: Annotated[KernelText, StringConstraints(max_length=4096)] | None = None


class ContextInfo(BaseModel):
    """E2B's `Context`: what its SDK reads from every context call."""

    id: str
    language: str
    cwd: str


@router.post("/contexts", summary="E2B: create a code context (a kernel in a new session)")
async def create_context(
    reached: PortReachedDep,
    service: ServiceDep,
    sandboxes: E2BDep,
    body: Annotated[CreateContext, Body()] = CreateContext(),  # noqa: B008 - a constant default
) -> ContextInfo:
    record, session = reached.record, reached.session
    # The new session has the same backend and image, so the same languages as this one.
    language = check_available(body.language or PYTHON, service.views.session_languages(session))
    cwd = body.cwd
    if language == "java" and cwd is not None:
        if posixpath.normpath(cwd) not in (E2B_HOME, WORKSPACE_IN_SANDBOX):
            raise E2BError(
                400,
                "a Java context cannot have a working directory of its own (a JVM keeps the "
                f"one it started in, {E2B_HOME}): leave cwd out, or use paths under it",
            )
        cwd = None  # where its kernel runs already
    if len(record.contexts) >= MAX_CONTEXTS:
        raise E2BError(429, f"a sandbox holds at most {MAX_CONTEXTS} contexts; remove one first")
    # Its volumes at the same paths: E2B's contexts share the sandbox's filesystem.
    spec = CreateSessionRequest(
        backend=session.backend, image=session.image, volumes=record.volumes
    )
    new = await service.lifecycle.create(record.owner, spec, workdir=E2B_HOME)
    # Checked again after the wait: the sandbox may have ended, or other contexts filled it.
    if not sandboxes.is_live(record) or len(record.contexts) >= MAX_CONTEXTS:
        await service.lifecycle.end(new.id, record.owner)
        if not sandboxes.is_live(record):
            raise SandboxGone(record.sandbox_id)
        raise E2BError(429, f"a sandbox holds at most {MAX_CONTEXTS} contexts; remove one first")
    context = await sandboxes.add_context(record, new, cwd, language)
    return ContextInfo(id=context.id, language=language, cwd=body.cwd or E2B_HOME)


@router.get("/contexts", summary="E2B: list the code contexts")
async def list_contexts(reached: PortReachedDep, service: ServiceDep) -> list[ContextInfo]:
    record = reached.record
    contexts = [
        ContextInfo(id=record.default_context_id(language), language=language, cwd=E2B_HOME)
        for language in service.views.session_languages(reached.session)
    ]
    contexts += [
        ContextInfo(id=c.id, language=c.language, cwd=c.cwd or E2B_HOME)
        for c in record.contexts.values()
    ]
    return contexts


@router.post("/contexts/{context_id}/restart", summary="E2B: restart a context's kernel")
async def restart_context(
    context_id: str, reached: PortReachedDep, service: ServiceDep
) -> Response:
    target = await context_target(service, reached, context_id)
    # A kernel not started yet is fresh already: starting one only to restart it is waste.
    if target.language in service.views.started_languages(target.session):
        await service.runs.restart(target.session, target.language)
    return Response(status_code=204)


@router.delete("/contexts/{context_id}", summary="E2B: remove a context")
async def remove_context(
    context_id: str, reached: PortReachedDep, service: ServiceDep, sandboxes: E2BDep
) -> Response:
    record = reached.record
    default = record.default_context_language(
        context_id, service.views.session_languages(reached.session)
    )
    if default is not None or context_id == DEFAULT_CONTEXT:
        raise E2BError(400, "a default context cannot be removed; kill the sandbox instead")
    context = record.contexts.get(context_id)
    if context is None:
        raise E2BError(404, f"Context {context_id} not found")  # E2B's words
    await sandboxes.remove_context(record, context)
    return Response(status_code=204)
