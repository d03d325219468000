#!/usr/bin/env bash
# Regenerate screenshots/: an SVG of every console view and key state, drawn by the same
# deterministic setups the snapshot tests use (frozen clock, fixed data, fixed terminal size).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest tests/console/test_tui_snapshots.py -q -p no:cacheprovider --snapshot-update
mkdir -p screenshots
rm -f screenshots/*.svg
for svg in tests/console/__snapshots__/test_tui_snapshots/test_*.svg; do
    name="$(basename "$svg")"
    cp "$svg" "screenshots/${name#test_}"
done
ls screenshots
