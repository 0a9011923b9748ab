"""What the docs' feature tables claim, held to the code: each backend's row in
docs/architecture.md to the capabilities the backend declares, and each E2B SDK call
docs/e2b.md says works to a test that makes that call through the real SDK. A feature that
lands, or goes, without its table changing fails here, not in a user's hands."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.backends.base import BackendCapabilities
from sandbox.backends.registry import BACKENDS, backend_type

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs/architecture.md"
E2B = ROOT / "docs/e2b.md"
# Where the E2B front's behaviour is tested through E2B's own SDKs.
E2B_TESTS = [
    *sorted((ROOT / "tests/clients/e2b_sdk").glob("*.py")),
    *sorted((ROOT / "tests/orchestrator/e2b_compatible").glob("*.py")),
    *sorted((ROOT / "tests/clients").glob("test_*e2b*.py")),
    *sorted((ROOT / "tests/gvisor").glob("test_*e2b*.py")),
]


def table(text: str, header: str) -> Iterator[tuple[int, list[str]]]:
    """(line, cells) of each row of the markdown table whose header row starts `header`."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if not line.startswith(header):
            continue
        for number in range(start + 2, len(lines)):
            if not lines[number].startswith("|"):
                break
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", lines[number].strip())[1:-1]]
            yield number + 1, cells


def _said(cell: str) -> bool:
    assert cell in ("yes", "no"), f"a capability cell says yes or no, not {cell!r}"
    return cell == "yes"


def declared(capabilities: BackendCapabilities) -> list[str]:
    """A backend's row as the table writes it, from what it declares."""
    flags = (
        capabilities.host_tools,
        capabilities.processes,
        capabilities.suspend,
        capabilities.snapshot,
        capabilities.shared_across_nodes,
        capabilities.images,
        capabilities.runtimes,
        capabilities.warm_pool,
        capabilities.ports,
        capabilities.root,
    )
    return [", ".join(capabilities.network_modes), *("yes" if f else "no" for f in flags)]


def test_the_backend_table_is_what_each_backend_declares() -> None:
    rows = {
        cells[0].strip("`"): (number, cells[1:])
        for number, cells in table(ARCHITECTURE.read_text(), "| backend | network |")
    }
    assert sorted(rows) == sorted(BACKENDS), "every backend has a row, and only backends do"
    for name in BACKENDS:
        number, cells = rows[name]
        for cell in cells[1:]:
            _said(cell)
        expected = declared(backend_type(name).capabilities)
        assert cells == expected, f"docs/architecture.md:{number}: {name} declares {expected}"


def called_names(cell: str) -> list[str]:
    """The SDK names a row's first cell calls or reads: `files.read(...)` gives `read`,
    `Sandbox.create(...)` `create`, `Result.chart` `chart`, `sbx.commands.*` `commands`."""
    names = []
    for code in re.findall(r"`([^`]+)`", cell):
        head = code.split("(", 1)[0].removesuffix(".*").strip()
        if re.fullmatch(r"[A-Za-z_][\w.]*", head):
            names.append(head.rsplit(".", 1)[-1])
    return names


def sdk_calls_said_to_work() -> list[tuple[str, str]]:
    text = E2B.read_text()
    found = []
    for header in ("| SDK call | works |", "| SDK call | RPC | works |"):
        for number, cells in table(text, header):
            works = cells[1] if header == "| SDK call | works |" else cells[2]
            if works == "no":
                continue
            found += [(f"docs/e2b.md:{number}", name) for name in called_names(cells[0])]
    return found


def test_the_e2b_tables_have_rows_and_every_refusal_says_why() -> None:
    text = E2B.read_text()
    calls = list(table(text, "| SDK call | works |"))
    rpcs = list(table(text, "| SDK call | RPC | works |"))
    assert len(calls) > 20 and len(rpcs) > 8
    for number, cells in calls:
        if cells[1] == "no":
            assert cells[2], f"docs/e2b.md:{number}: a call that does not work says why"


@pytest.mark.parametrize(("where", "name"), sdk_calls_said_to_work())
def test_an_sdk_call_the_docs_say_works_is_made_by_a_test(where: str, name: str) -> None:
    """The claim is only as good as a test making the call through E2B's SDK."""
    pattern = re.compile(rf"[.\s]{re.escape(name)}\b")
    assert any(pattern.search(path.read_text()) for path in E2B_TESTS), (
        f"{where} says `{name}` works, but no E2B SDK test calls it"
    )
