"""The settings cut into the parts' sections: the flat surface the operator writes lands in the
section of the part that uses it, sections cannot be changed, and no section invents a name."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.config import Settings
from orchestrator.front_config import FrontConfig
from orchestrator.service_endpoints import service_endpoints
from orchestrator.settings_sections import Section, Sections
from sandbox.egress.settings import ServiceEndpoint

pytestmark = pytest.mark.unit


def cut(settings: Settings) -> Sections:
    return Sections.of(settings, service_endpoints(settings))


def test_an_environment_variable_lands_in_its_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODE_INTERPRETER_AUDIT_MAX_EVENTS", "1234")
    monkeypatch.setenv("CODE_INTERPRETER_IDLE_TIMEOUT_S", "77")
    monkeypatch.setenv("CODE_INTERPRETER_APPROVAL_TIMEOUT_S", "9")
    sections = cut(Settings(auth_disabled=True, state_dir=tmp_path))
    assert sections.audit.audit_max_events == 1234
    assert sections.expiry.idle_timeout_s == 77
    assert sections.views.idle_timeout_s == 77  # one setting, the same in every section
    assert sections.approvals.approval_timeout_s == 9
    assert sections.channels.approval_timeout_s == 9
    assert sections.storage.state_dir == tmp_path


def test_sections_cannot_be_changed(tmp_path: Path) -> None:
    sections = cut(Settings(auth_disabled=True, state_dir=tmp_path))
    with pytest.raises(ValidationError):
        sections.audit.audit_enabled = False  # type: ignore[misc]
    with pytest.raises(ValidationError):
        sections.audit = sections.audit  # type: ignore[misc]


def test_every_section_field_is_a_setting_or_derived_by_the_root() -> None:
    flat = set(Settings.model_fields)
    derived = {"service_endpoints", "volume_images"}
    for name, field in Sections.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, Section), name
        invented = set(section.model_fields) - flat - derived
        assert not invented, f"{name} has fields no setting holds: {sorted(invented)}"
    assert not set(FrontConfig.model_fields) - flat  # the fronts' section too


def test_the_egress_section_refuses_the_services_own_endpoints(tmp_path: Path) -> None:
    settings = Settings(auth_disabled=True, state_dir=tmp_path, host="127.0.0.1", port=8123)
    egress = cut(settings).egress
    assert ServiceEndpoint("the service's own API", "127.0.0.1", 8123) in egress.service_endpoints
    assert egress.network_ceiling == settings.network_ceiling


def test_admission_offers_the_internet_the_settings_name(tmp_path: Path) -> None:
    settings = Settings(auth_disabled=True, state_dir=tmp_path)
    assert cut(settings).admission.internet_policy == settings.internet_policy
