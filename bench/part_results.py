"""Where a part of `make bench` run alone (`python -m bench.<part>`) leaves its figures:
bench/results/<part>.json and .md, the same files each time, and the table printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def save_part(part: str, figures: dict[str, Any], lines: list[str]) -> None:
    """Write the part's figures and its Markdown section, then print the section."""
    markdown = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{part}.json").write_text(json.dumps(figures, indent=2) + "\n")
    (RESULTS / f"{part}.md").write_text(markdown)
    print(markdown)
