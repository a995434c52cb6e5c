#!/usr/bin/env bash
# Refresh docs/flow-run.png, the README's picture of a flow run in the Prefect UI: runs the
# screenshot test (a real server, `goodput serve`, a pipeline run from the UI's API, headless
# Chromium), which copies its picture to $GOODPUT_SCREENSHOT. About two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p docs
GOODPUT_SCREENSHOT="$PWD/docs/flow-run.png" \
  python -m pytest tests/test_prefect_surface.py -q -k test_screenshot_of_the_flow_run_page
echo "wrote docs/flow-run.png"
