#!/usr/bin/env bash
# Quick start, step one: system packages, the virtual environment, and a first real job in the
# embedded default sandbox (bubblewrap). Images it draws land in ./outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-system-packages.sh
make install
make demo
