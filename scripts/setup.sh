#!/usr/bin/env bash
# Creates .venv with everything Goodput needs. Idempotent: a second run installs nothing new.
# On a machine without a GPU it installs the CPU build of torch first, so nothing pulls a
# multi-GB CUDA build; bring your own CUDA torch into the venv on GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11,<2.15"
  else
    pip install -q torch==2.13.0
  fi
fi
pip install -q -e ".[test]"
# System packages the tests start for real, installed only where that is possible without
# asking: as root with apt (CI). Elsewhere the tests that need them are skipped, saying why.
#   chromium, chromium-driver: the test that screenshots the Prefect UI
#   slurm-wlm (with munge):    the two-node Slurm cluster of tests/test_slurm.py
#   postgresql:                the production Prefect stack (server on PostgreSQL)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  wanted=()
  command -v chromedriver >/dev/null 2>&1 || wanted+=(chromium chromium-driver)
  command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || wanted+=(slurm-wlm)
  command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    || wanted+=(postgresql)
  if [ ${#wanted[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null
  fi
fi
