#!/usr/bin/env bash
# What only a lent GPU can show (issues 3, 36, 37), in one device call of under 10 minutes.
#
#   bash scripts/gpu_wheels.sh                       # here, once: what the image lacks (60 MB)
#   device run: bash benchmarks/device_session.sh    # carry [".goodput/wheels"], timeout_s 600
#   bash benchmarks/device_session.sh --smoke        # each part at its smallest, on this CPU
#
# Parts, in order of what the issues need most; each has a time limit of its own, writes its
# results to $OUT (or --out DIR) whatever happened, and the next part runs regardless (the
# device brings back 8 files at most: these are 7):
#   mfu.json (+ mfu-gpt2-124m-rank0.trace.json.gz)  the 124M step's MFU (micro-batch 64),
#                                                   then 3 profiled steps (top kernels in the
#                                                   JSON, the trace)
#   prepare.json         `goodput prepare` of a 500 MB corpus on the machine's 16 cores
#                        against raw encode_batch and datasets.map(num_proc=16) (item 4),
#                        with the work units' timeline (benchmarks/prepare_timeline.py)
#   eval.json            evaluation on the GPU (issue 37 item 1, never run on one before):
#                        eval_bench.py --part backends --device cuda, a 97.5M checkpoint, three
#                        tasks at eval.limit=200 under lm-eval's hf model, the path before
#                        issue 37, ProjectLM fp32 and bf16 (what eval.precision=auto picks
#                        there); seconds, scores and log-likelihood differences
#   moe.json             the mixture-of-experts model trained on the GPU (bf16, NCCL); in
#                        the log, moe_kernels.py: grouped_mm against a matmul per expert
#   mfu_1b.json          the ~1B model, its 52% kept?
#   session.log          every part's output, with the card (nvidia-smi) first
# cuda_paths.py (async checkpoint staging and resume on CUDA; init_from's logits) passed on
# the H100 on 26 Nov and is left out: run it alone when CUDA code there changes. So are, after
# their figures on the H200 on 30 Nov: the 124M step at micro-batch 32 (its figure until then),
# with CUDA graphs (parallelism.compile_mode=reduce-overhead: 45.0% against 44.7%, within
# noise), and the output layer's loss in chunks (loss_chunks_bench.py: it does not pay there).
# Results belong in benchmarks/RESULTS.md with this command and the card.
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0
out=${OUT:-}
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) smoke=1 ;;
        --out) out=$2; shift ;;
        *) echo "usage: $0 [--smoke] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$out" ] || { echo "give --out DIR (or set OUT)" >&2; exit 2; }
mkdir -p "$out"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$smoke" = 1 ] && python=.venv/bin/python
export PYTHONUNBUFFERED=1
log=$out/session.log
: >"$log"

# The whole session ends before the device's 600 s a command: a part gets its own limit or
# what is left, whichever is less, and is skipped with under 30 s left.
session_s=${SESSION_S:-580}
[ "$smoke" = 1 ] && session_s=$((session_s * 4))  # the CPU here, shared: slower than the GPU

# part NAME SECONDS COMMAND...: run it under a time limit, its output to the log.
part() {
    local name=$1 limit=$2
    shift 2
    [ "$smoke" = 1 ] && limit=$((limit * 3))
    local left=$((session_s - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "=== $name: skipped, ${left}s left of the session's ${session_s}s" | tee -a "$log"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local status=$?
    echo "=== $name: exit $status after $((SECONDS - began))s" | tee -a "$log"
}

# What the image lacks (pydantic, boto3, Prefect, datasets, lm-eval), from the carried wheels.
if ! "$python" -c "import pydantic, boto3, prefect, datasets, lm_eval" 2>/dev/null; then
    site=/tmp/goodput-site-device
    if "$python" -m pip install --quiet --no-index --no-deps --no-compile \
            --disable-pip-version-check --upgrade --target "$site" .goodput/wheels/*.whl >>"$log" 2>&1; then
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "=== wheels: not installed; run scripts/gpu_wheels.sh here and carry .goodput/wheels" | tee -a "$log"
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    "$python" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} >>"$log" 2>&1

if [ "$smoke" = 1 ]; then
    device=cpu
    mfu=(--sizes tiny --device cpu --no-compile --warmup-steps 2 --steps 3)
    evaluation=(--device cpu --model tiny --limit 8 --tasks piqa,lambada)
    prepare=(--sizes 2MB --cores 2)
    moe=(--device cpu --nproc 1 --rounds 1 --steps 5 --dim 64 --layers 2 --heads 4 --expert-dim 128 --vocab 512 --seq 64)
    moe_kernels=(--device cpu --tokens 1024 --dim 64 --hidden 128 --repeats 2)
    mfu_1b=(--sizes tiny --device cpu --no-compile --warmup-steps 2 --steps 3)
else
    device=cuda
    mfu=(--sizes gpt2-124m --device cuda)
    evaluation=(--device cuda --model 100m --limit 200 --tasks hellaswag,lambada,winogrande)
    prepare=(--sizes 500MB --cores 16)
    moe=(--device cuda --nproc 1 --rounds 1 --steps 20 --dim 1024 --layers 8 --heads 16 --expert-dim 2048 --vocab 32000 --seq 1024 --batch 16)
    moe_kernels=(--device cuda)
    mfu_1b=(--sizes 1b --device cuda)
fi

part mfu 100 "$python" benchmarks/mfu_bench.py "${mfu[@]}" --profile 3 --budget-s 95 \
    --out "$out/mfu.json"
part prepare 210 "$python" benchmarks/prepare_bench.py "${prepare[@]}" --json "$out/prepare.json"
part eval 150 "$python" benchmarks/eval_bench.py --part backends "${evaluation[@]}" \
    --out "$out/eval.json"
part moe 35 bash -c "$python benchmarks/moe_bench.py ${moe[*]} --arms fsdp --json '$out/moe.json'"
part moe_kernels 15 "$python" benchmarks/moe_kernels.py "${moe_kernels[@]}"
part mfu_1b 65 "$python" benchmarks/mfu_bench.py "${mfu_1b[@]}" --no-attention-check \
    --budget-s 60 --out "$out/mfu_1b.json"
echo "=== done: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
