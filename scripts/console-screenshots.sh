#!/usr/bin/env bash
# Makes the console's screenshots in a real browser (the browser tests write them to
# test-artifacts/console/), then copies those docs/governance.md shows to docs/images/, made
# small (a palette of 256 colours) so that they are fit to commit.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest -q -p no:randomly tests/orchestrator/governance/test_console_browser.py
mkdir -p docs/images
.venv/bin/python - <<'PY'
from pathlib import Path

from PIL import Image

made, docs = Path("test-artifacts/console"), Path("docs/images")
for name in ("console-login", "console-sessions", "console-session", "console-approvals",
             "console-approved", "console-audit"):
    image = Image.open(made / f"{name}.png").convert("RGB")
    small = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(docs / f"{name}.png", optimize=True)
    print(f"docs/images/{name}.png: {(docs / f'{name}.png').stat().st_size // 1024} KiB")
PY
