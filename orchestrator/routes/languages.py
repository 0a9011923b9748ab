"""The languages this deployment runs, per backend: what a client may pass as `language`."""

from __future__ import annotations

from fastapi import APIRouter

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.languages import LANGUAGES
from code_interpreter_wire.rest import LanguagesResponse
from orchestrator.routes.deps import OwnerDep, ServiceDep

router = APIRouter(prefix="/v1/languages", tags=["languages"])


@router.get("", summary="The languages new sessions have, on each backend")
async def languages(service: ServiceDep, owner: OwnerDep) -> LanguagesResponse:
    """A backend that cannot say (e.g. its image is missing) lists none: a session there
    fails to start and says why."""
    by_backend: dict[str, list[str]] = {}
    for name in service.views.backend_names():
        try:
            by_backend[name] = await service.views.languages(name)
        except SandboxError:
            by_backend[name] = []
    default = service.views.default_backend()
    return LanguagesResponse(
        default_backend=default,
        languages=by_backend.get(default, []),
        backends=by_backend,
        aliases={name: list(language.aliases) for name, language in LANGUAGES.items()},
    )
