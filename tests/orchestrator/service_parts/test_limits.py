"""Limits are declared once, on ResourceLimits: the request model and the ceilings derive from it.

The ceilings bind what a session's request may ask, not the model: an operator's defaults and
in-process callers may go past them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from code_interpreter_wire.rest import CreateSessionRequest, LimitsRequest
from code_interpreter_wire.spec import ResourceLimits, limit_ceilings
from orchestrator.config import Settings
from orchestrator.service_parts.admission import LIMITS_CEILING

pytestmark = pytest.mark.unit


def test_every_limit_has_a_ceiling_and_a_request_field() -> None:
    fields = set(ResourceLimits.model_fields)
    assert set(limit_ceilings()) == fields == set(LIMITS_CEILING)
    assert set(LimitsRequest.model_fields) == fields
    for name in fields:  # each optional, described as the limit is
        request_field = LimitsRequest.model_fields[name]
        assert request_field.default is None
        assert request_field.description == ResourceLimits.model_fields[name].description


def test_a_request_names_only_what_it_changes() -> None:
    request = CreateSessionRequest.model_validate({"limits": {"memory_mb": 512}})
    assert request.limits is not None
    assert request.limits.model_dump(exclude_none=True) == {"memory_mb": 512}


def test_ceilings_bind_requests_not_the_model(tmp_path: Path) -> None:
    big = {name: ceiling * 2 for name, ceiling in LIMITS_CEILING.items()}
    assert ResourceLimits(**big).memory_mb == LIMITS_CEILING["memory_mb"] * 2
    settings = Settings(state_dir=tmp_path, auth_disabled=True, default_limits=big)
    assert settings.default_limits.cpus == LIMITS_CEILING["cpus"] * 2
