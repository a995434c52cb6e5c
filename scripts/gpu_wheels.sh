#!/usr/bin/env bash
# Wheels of the Python packages the lent GPU machines' image lacks, for the benchmarks run there.
#
# That image has torch, numpy, pyarrow, PyYAML, tokenizers and transformers, but not pydantic
# (core.config), boto3 (storage/), Prefect, datasets (benchmarks/prepare_bench.py runs
# `goodput prepare` and datasets.map) nor lm-eval (eval_bench.py --part backends --device
# cuda), and it cannot reach a package index. Run this where PyPI is reachable: it downloads
# the versions installed in .venv of what those need (their whole dependency closure, less
# what the image holds), built for the GPU machine's Python (3.12, x86-64 Linux), into
# .goodput/wheels (ignored by git; about 60 MB: with the working tree, under the device's
# 64 MiB a call). Carry that folder to the device; benchmarks/device_session.sh, mfu_bench.py
# and cuda_paths.py install them there before they start:
#
#     bash scripts/gpu_wheels.sh [DEST] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.goodput/wheels}
python_version=${2:-3.12}
python=${PYTHON:-.venv/bin/python}
pins=$(TARGET_PYTHON="$python_version" "$python" - <<'EOF'
import os
import re
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

NEEDED = ["pydantic", "boto3", "prefect", "datasets", "lm_eval"]
# lm-eval's dependencies that come as source only, for metrics and caches evaluation here never
# uses (rouge, word2number, sqlitedict's response cache): left out, with what only they need.
SOURCE_ONLY = {"rouge-score", "word2number", "sqlitedict"}
# The lent machines' image ('cuda', as the device tool's KINDS.md listed it on 2026-11-17): what
# it holds is not downloaded (torch and the CUDA libraries above all).
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split())


def name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


found: dict[str, str] = {}


def walk(package: str) -> None:
    if name(package) in found or name(package) in IMAGE or name(package) in SOURCE_ONLY:
        return
    try:
        dist = distribution(package)
    except PackageNotFoundError:  # an optional dependency this .venv does not have
        return
    found[name(package)] = dist.version
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(
                {"extra": "", "python_version": os.environ["TARGET_PYTHON"], "sys_platform": "linux",
                 "platform_system": "Linux", "platform_machine": "x86_64"}):
            walk(requirement.name)


for package in NEEDED:
    walk(package)
print(" ".join(f"{package}=={version}" for package, version in sorted(found.items())))
EOF
)
mkdir -p "$dest"
# shellcheck disable=SC2086  # one word per package
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --dest "$dest" $pins
echo "wheels for Python $python_version in $dest ($(du -sh "$dest" | cut -f1)):"
ls -1 "$dest"
