#!/usr/bin/env bash
# Wheels of the trainer's Python dependencies that the lent GPU machines' image lacks.
#
# That image has torch, numpy, pyarrow and PyYAML but not pydantic (core.config) nor boto3
# (storage/ imports it), and it cannot reach a package index. Run this where PyPI is
# reachable; it downloads the versions installed in .venv, built for the GPU machine's
# Python (3.12, x86-64 Linux), into .goodput/wheels (ignored by git). Carry that folder to
# the device and benchmarks/mfu_bench.py installs them there before it starts:
#
#     bash scripts/gpu_wheels.sh [DEST] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.goodput/wheels}
python_version=${2:-3.12}
python=${PYTHON:-.venv/bin/python}
# The image has python-dateutil, six and urllib3 too; they come along all the same, so the
# set imports on any Python with torch, numpy, pyarrow and PyYAML.
packages="pydantic pydantic-core annotated-types typing-inspection typing-extensions
          boto3 botocore s3transfer jmespath python-dateutil six urllib3"
# shellcheck disable=SC2086  # one word per package
pins=$("$python" - $packages <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
mkdir -p "$dest"
# shellcheck disable=SC2086
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --dest "$dest" $pins
echo "wheels for Python $python_version in $dest:"
ls -1 "$dest"
