"""The settings tables of the README and docs/ name real settings, with their real defaults: an
operator reads them, not config.py, and a setting renamed or a default changed in config.py alone
would mislead them without a word."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from orchestrator.config import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    "README.md",
    "docs/governance.md",
    "docs/network.md",
    "docs/persistence.md",
    "docs/cluster.md",
    "docs/ports.md",
    "docs/secrets.md",
]
UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "day": 86400, "days": 86400, "s": 1}
# Defaults the docs say in words, not as a value (what the setting falls back on).
IN_WORDS = {"network_internet", "ray_address", "ray_node_ip", "console_secret", "docker_images"}


def settings_rows(text: str) -> Iterator[tuple[int, list[str], str]]:
    """(line, setting names, default cell) of each row of a `| setting | default |` table."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if not line.startswith("| setting | default |"):
            continue
        for number in range(start + 2, len(lines)):
            if not lines[number].startswith("|"):
                break
            cells = [c.strip() for c in lines[number].strip("|").split("|")]
            names = re.findall(r"`([A-Za-z_]+)`", cells[0])
            yield number + 1, [n.removeprefix("CODE_INTERPRETER_").lower() for n in names], cells[1]


def rows() -> list[tuple[str, list[str], str]]:
    found = []
    for document in DOCUMENTS:
        for number, names, default in settings_rows((ROOT / document).read_text()):
            found.append((f"{document}:{number}", names, default))
    return found


def said(default: str) -> object:
    """A default as the docs write it (`true`, 300, 10,000, 100 MiB, 90 days, (none)), as a
    value; None for none; the text itself when it is no value."""
    text = default.strip().strip("`").strip()
    text = re.sub(r"\s*\(.*\)$", "", text) if not text.startswith("(") else text
    if text.startswith("(") or text.lower() in ("none", "empty", ""):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    number = re.fullmatch(r"([\d,]+(?:\.\d+)?)\s*([A-Za-z]*)", text)
    if number is not None and (not number.group(2) or number.group(2).lower() in UNITS):
        return float(number.group(1).replace(",", "")) * UNITS.get(number.group(2).lower(), 1)
    return text


def actual(name: str) -> object:
    value = Settings.model_fields[name].get_default(call_default_factory=True)
    if value in ([], {}, ()):
        return None
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return str(value)


def test_the_tables_are_found() -> None:
    named = {name for _, names, _ in rows() for name in names}
    assert {"approval_timeout_s", "audit_max_events", "console_secret", "api_keys"} <= named


@pytest.mark.parametrize(("where", "names", "default"), rows(), ids=[w for w, _, _ in rows()])
def test_each_setting_exists_with_the_default_the_docs_say(
    where: str, names: list[str], default: str
) -> None:
    for name in names:
        assert name in Settings.model_fields, f"{where}: no setting {name!r}"
    if not default:
        return
    parts = [p.strip() for p in default.split(", ")] if len(names) > 1 else [default]
    if len(parts) == 1:
        parts *= len(names)
    assert len(parts) == len(names), f"{where}: {len(names)} settings, defaults {default!r}"
    for name, part in zip(names, parts, strict=True):
        value = actual(name)
        if name in IN_WORDS or isinstance(
            Settings.model_fields[name].get_default(call_default_factory=True), BaseModel
        ):
            continue  # said in words, or a table of its own
        assert said(part) == value, f"{where}: {name} defaults to {value!r}, the docs say {part!r}"


def test_a_wrong_default_is_caught() -> None:
    """The check can fail: 300 is not approval_timeout_s's default, 120 s is."""
    assert said("300") != actual("approval_timeout_s")
    assert said("120") == actual("approval_timeout_s")
    assert said("90 days") == actual("audit_retention_s") and said("10,000") == 10_000
    assert said("(none)") is None and said("`true`") is True and said("100 MiB") == 100 << 20
