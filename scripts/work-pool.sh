#!/usr/bin/env bash
# One machine, one process work pool: create the pool `goodput` (if missing), deploy every
# deployment of prefect.yaml to it, and run a worker in the foreground. Idempotent.
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api scripts/work-pool.sh
#
# Flow runs start in $GOODPUT_REPO (default: this repository), with its .venv. Ctrl-C stops
# the worker; the pool and the deployments stay.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# A .venv shared with another checkout runs that checkout's flows: every flow run would fail
# on the mismatch (flows/deployments.py), so say it here, before anything is deployed.
# (From /: run here, Python would import this directory's flows/ whatever the .venv holds.)
installed=$(cd / && python -c 'import flows, pathlib; print(pathlib.Path(flows.__file__).resolve().parents[1])')
if [ "$installed" != "$(pwd -P)" ]; then
    echo "work-pool.sh: this .venv runs the flows of $installed, not of $(pwd -P): run the" \
         "script from $installed, or give this checkout a .venv of its own (make setup)" >&2
    exit 2
fi
export GOODPUT_REPO=${GOODPUT_REPO:-$PWD}
export PREFECT_SERVER_ANALYTICS_ENABLED=${PREFECT_SERVER_ANALYTICS_ENABLED:-false}
POOL=goodput  # the pool prefect.yaml's deployments name

prefect work-pool inspect "$POOL" >/dev/null 2>&1 || prefect work-pool create "$POOL" --type process
prefect --no-prompt deploy --all
exec prefect worker start --pool "$POOL" --type process
