"""What the checkpoint verifier takes from training workers on busy cores, with its session's
scheduling group at nice 0 (as it ran before) and lowered to nice 19 (core.cpu_priority's
lower_session_priority, as goodput.verifier_pool starts it now).

    python benchmarks/session_priority_bench.py [--workers 2] [--size-mb 400] [--seconds 20] [--rounds 3]

The workers stand for torchrun's: each a process in a session of its own (torchrun starts
its workers so) running a one-thread matmul block of a ~100M-parameter model's size over and
over, one per core by default, so no core is left idle. Beside them the real verifier
(goodput.verifier_pool, `python -m training.checkpoint.verify --serve --background`: threads
at SCHED_IDLE and nice 19, in a session of its own) judges a real checkpoint of --size-mb
again and again. Each round measures three arms in turn for --seconds: the workers alone,
beside the verifier with its group at nice 0, beside the verifier with its group lowered.
Prints the workers' median block time against alone, and the verdicts the verifier gave per
minute (the idle cycles it still gets). On a kernel without autogroups (or in a cgroup
under Slurm or Kubernetes) the two verifier arms are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORKER = """
import statistics, sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
up, down, x = torch.randn(640, 2560), torch.randn(2560, 640), torch.randn(2048, 640)
for line in sys.stdin:  # one line per measurement: its length in seconds
    times, end = [], time.monotonic() + float(line)
    while time.monotonic() < end:
        start = time.perf_counter()
        (x @ up).relu_() @ down
        times.append(time.perf_counter() - start)
    print(statistics.median(times), flush=True)
"""


def make_checkpoint(directory: Path, size_mb: int) -> Path:
    """A committed checkpoint of the project's model with about `size_mb` of weights and
    AdamW state (12 bytes a parameter), written by the trainer's own saver."""
    import torch

    from training.checkpoint.saving import Saver
    from training.model import ModelArgs, Transformer

    def args(layers: int) -> ModelArgs:
        return ModelArgs(vocab_size=8192, dim=640, n_layers=layers, n_heads=10, max_seq_len=256)

    layers = 1
    with torch.device("meta"):  # shapes only, to size it
        while Transformer(args(layers)).num_params(non_embedding=False) * 12 < size_mb << 20:
            layers += 1
    model = Transformer(args(layers))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 8192, (1, 16)), torch.randint(0, 8192, (1, 16))).backward()
    optimizer.step()
    path = directory / "step-00000001"
    saver = Saver("sync")
    saver.save(path, [model], [optimizer], {}, dict(
        step=1, tokens_seen=0, world_size=1, layout={}, config_hash="bench", dataset_id="bench",
        model_args=vars(model.args), loss=1.0))
    saver.close()
    assert not saver.failures, saver.failures
    return path


def measure(workers: list[subprocess.Popen], seconds: float) -> list[float]:
    for w in workers:
        w.stdin.write(f"{seconds}\n")
        w.stdin.flush()
    return [float(w.stdout.readline()) for w in workers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (one per core leaves none idle)")
    parser.add_argument("--size-mb", type=int, default=400, help="checkpoint size")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from goodput.verifier_pool import _Verifier

    arms = {"workers alone": None, "beside the verifier, its group at nice 0 (before)": "0",
            "beside the verifier, its group at nice 19 (now)": "19"}
    blocks: dict[str, list[float]] = {arm: [] for arm in arms}
    verdicts: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_checkpoint(Path(scratch), args.size_mb)
        workers = [subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
                   for _ in range(args.workers)]
        try:
            measure(workers, 1.0)  # warm up
            for _ in range(args.rounds):
                for arm, group_nice in arms.items():
                    verifier, judged, stop = None, [], threading.Event()
                    if group_nice is not None:
                        verifier = _Verifier()  # lowered as the pool starts it
                        Path(f"/proc/{verifier.process.pid}/autogroup").write_text(group_nice)

                        def judge_again(v=verifier, judged=judged, stop=stop):
                            while not stop.is_set():
                                verdict = v.judge([str(checkpoint)], timeout_s=3600)
                                if stop.is_set():  # killed at the arm's end
                                    return
                                if verdict is None or not verdict["ok"]:
                                    raise RuntimeError(f"verifier: {verdict} {v.stderr_tail()}")
                                judged.append(time.monotonic())

                        threading.Thread(target=judge_again, daemon=True).start()
                        time.sleep(1.0)  # into its first verification
                    began = time.monotonic()
                    blocks[arm].append(statistics.median(measure(workers, args.seconds)))
                    verdicts[arm].append(len([t for t in judged if t >= began]) * 60 / args.seconds)
                    stop.set()
                    if verifier is not None:
                        verifier.kill()
                    print(f"{arm}: block {blocks[arm][-1] * 1e3:.1f} ms, "
                          f"{verdicts[arm][-1]:.1f} verdicts a minute", flush=True)
        finally:
            for w in workers:
                w.kill()
                w.wait()
    print(json.dumps({"blocks_s": blocks, "verdicts_per_min": verdicts}), file=sys.stderr)
    alone = statistics.median(blocks["workers alone"])
    print(f"\n{args.workers} workers, a {args.size_mb} MB checkpoint, {args.rounds} rounds of "
          f"{args.seconds:.0f} s\n")
    print("| arm | workers' median block (ms) | vs alone: median [lowest-highest round] | verifier's verdicts a minute |")
    print("|---|---|---|---|")
    for arm in arms:
        ratios = sorted(t / alone for t in blocks[arm])
        print(f"| {arm} | {statistics.median(blocks[arm]) * 1e3:.1f} | {statistics.median(ratios):.2f}x "
              f"[{ratios[0]:.2f}-{ratios[-1]:.2f}] | "
              f"{statistics.median(verdicts[arm]):.1f} |" if arms[arm] else
              f"| {arm} | {alone * 1e3:.1f} | 1.00x | - |")


if __name__ == "__main__":
    main()
