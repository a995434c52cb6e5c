"""The planner against the training runs the field has published (tests/test_plan.py's PUBLISHED).

    python benchmarks/plan_vs_published.py            # a markdown table on stdout
    python benchmarks/plan_vs_published.py --json out.json

For each run: its layout, the published tokens/s per GPU and MFU (one of them published, the
other from the model's FLOPs per token), what the planner plans for the same layout with its
one set of constants (goodput/planner.py), the ratio planned / published, and the planned
peak memory against the GPU's (with the published peak where the authors give one). Pure
arithmetic: a second on a laptop. tests/test_plan.py asserts every ratio within 0.8-1.2 and
every layout accepted on its hardware.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from goodput import planner  # noqa: E402
from tests.test_plan import PUBLISHED  # noqa: E402

GIB = 2**30


def rows() -> list[dict]:
    out = []
    for name, run in PUBLISHED.items():
        config = run.load()
        dims = config.parallelism.dims(run.cluster.world_size, "the cluster")
        flops = planner.model_flops_per_token(planner.model_args(config), config.training.seq_len)
        published = run.published_per_gpu()
        row = {"run": name, "source": run.source, "recipe": run.recipe.name,
               "gpus": run.cluster.world_size,
               "layout": run.layout or (f"dp {dims.dp_size} x tp {dims.tp} x pp {dims.pp}" + (
                   f" (v={dims.stages_per_rank})" if dims.stages_per_rank > 1 else "")),
               "published_tokens_per_gpu": published,
               "published_mfu": published * flops / run.cluster.gpu_flops,
               "published_memory_gib": run.memory_gib,
               "gpu_memory_gib": run.cluster.gpu_memory / GIB}
        if run.skip:
            row["skipped"] = run.skip
            out.append(row)
            continue
        plan = run.plan()
        planned = plan.tokens_per_s / run.cluster.world_size
        row |= {"planned_tokens_per_gpu": planned, "planned_mfu": plan.mfu,
                "ratio": planned / published, "planned_peak_gib": plan.memory.peak / GIB,
                "fits": plan.ok}
        out.append(row)
    return out


def table(result: list[dict]) -> str:
    lines = ["| run | GPUs | layout | published tokens/s/GPU | published MFU | planned tokens/s/GPU "
             "| planned MFU | ratio | planned peak / GPU memory (published) | fits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result:
        head = (f"| {r['run']} | {r['gpus']:,} | {r['layout']} | {r['published_tokens_per_gpu']:,.0f} "
                f"| {r['published_mfu']:.1%} ")
        if "skipped" in r:
            lines.append(head + f"| - | - | - | - | skipped: {r['skipped']} |")
            continue
        memory = f"{r['planned_peak_gib']:.1f} / {r['gpu_memory_gib']:.0f} GiB"
        if r["published_memory_gib"] is not None:
            memory += f" ({r['published_memory_gib']:.1f})"
        lines.append(head + f"| {r['planned_tokens_per_gpu']:,.0f} | {r['planned_mfu']:.1%} "
                     f"| {r['ratio']:.2f} | {memory} | {'yes' if r['fits'] else 'NO'} |")
    ratios = [r["ratio"] for r in result if "ratio" in r]
    lines += ["", f"{len(ratios)} runs planned, ratios {min(ratios):.2f} to {max(ratios):.2f}; "
                  f"{sum(r['fits'] for r in result if 'fits' in r)} of {len(ratios)} layouts fit. "
                  f"Constants: matmuls {planner.MATMUL_EFFICIENCY}, attention "
                  f"{planner.ATTENTION_EFFICIENCY}, memory {planner.MEMORY_EFFICIENCY}, links "
                  f"{planner.LINK_EFFICIENCY}, data-parallel overlap {planner.COMM_OVERLAP}, "
                  f"float8 x{planner.FLOAT8_SPEEDUP}, AsyncTP overlap {planner.ASYNC_TP_OVERLAP}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    result = rows()
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
