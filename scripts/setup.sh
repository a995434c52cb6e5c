#!/usr/bin/env bash
# Creates .venv with everything Goodput needs. Idempotent: a second run installs nothing new.
# On a machine without a GPU it installs the CPU build of torch first, so nothing pulls a
# multi-GB CUDA build; bring your own CUDA torch into the venv on GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
# Before any install, a pip whose resolver is fast: resolving ".[test]" (239 packages) took
# 180 s of a core with pip 23.2, what Python 3.11's venv brings, and 34 s with pip 26.3,
# which chose the same versions. Checked without running pip, so a setup with nothing to
# install pays nothing; where no index answers, the pip at hand installs, only slower.
# Capped at the series measured: a newer one already in the venv is kept as it is.
recent_pip() {
  python -c "import importlib.metadata as m, sys; sys.exit(int(m.version('pip').split('.')[0]) < 26)" \
    || pip install -q "pip>=26,<27" || echo "setup: pip not upgraded; installing with $(pip --version)"
}
# (Found, not imported: importing torch took 2-3 s of every `make pipeline`.)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  recent_pip
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11,<2.15"
  else
    pip install -q torch==2.13.0
  fi
fi
# Installed again only when pyproject.toml changed since (its hash kept in the venv) or the
# install is broken: pip's resolve alone took 19 s of every `make pipeline`. The code itself
# is installed editable: a change to it needs no install. GOODPUT_REINSTALL=1 forces one.
installed_from=.venv/.goodput-installed-from
wanted_install="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "${GOODPUT_REINSTALL:-0}" = 1 ] || [ "$(cat "$installed_from" 2>/dev/null)" != "$wanted_install" ] \
    || ! (cd / && "$VIRTUAL_ENV/bin/python" -c "import flows.cli, pytest" 2>/dev/null); then
  recent_pip
  pip install -q -e ".[test]"
  echo "$wanted_install" > "$installed_from"
fi
# Goodput's own modules byte-compiled, as pip compiles what it installs: where
# PYTHONDONTWRITEBYTECODE is set (these machines, many containers) every process compiled
# them at import, 0.2 s of each torchrun worker and 0.4 s of each command. Checked by the
# source's hash, so an edit made during or after the compile is never served stale. Only a
# speed-up: it never fails the setup (a module's syntax error shows where it is imported).
packages=(core goodput flows tasks training storage infra)  # pyproject.toml's packages.find
compiled_at=.venv/.goodput-compiled
if [ ! -e "$compiled_at" ] || [ -n "$(find "${packages[@]}" -name '*.py' -newer "$compiled_at" -print -quit)" ]; then
  touch "$compiled_at"  # first: a module saved during the compile is compiled again next time
  python -m compileall -q --invalidation-mode checked-hash "${packages[@]}" >/dev/null 2>&1 || true
fi
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
