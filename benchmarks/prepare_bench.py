"""Data preparation at corpus scale: memory, disk, throughput and the no-op rerun.

    python benchmarks/prepare_bench.py --sizes 100MB 500MB 2GB [--workdir DIR] [--json OUT]

For each size it generates a corpus of real-shaped documents (0.5-5 kB of word-like text
drawn from a Zipf vocabulary, JSON Lines in files of 64 MB, deterministic), then runs
`goodput prepare` on it as a user would (a fresh process, Prefect's temporary server
included) and reports:

- peak RSS of the whole process tree (sampled every 0.25 s, all processes summed);
- disk written by the tree (its block writes, getrusage of the reaped children) beyond the
  output (the dataset dir plus its copy in the local store), as a share of the input. The
  Prefect home exists already, as on any machine that ran a flow before: what creating it
  (Prefect's SQLite database) writes, once per machine, is measured by a flow run that does
  nothing, and reported apart;
- tokenizing throughput (tokens / wall time of the work units, from summary.json) against
  raw `tokenizers` `encode_batch` on the same texts, tokenizer and cores (one process per
  core, each on an equal byte share of the files) and against `datasets.map(batched=True,
  num_proc=cores)` doing the same (only for sizes up to --map-max, it copies the corpus),
  twice: mapping `tokenizers`' encode_batch, and mapping a `transformers` fast tokenizer's
  `tokenizer(batch["text"])` as transformers' run_clm.py example does;
- a no-op rerun: the library's decision that there is no work (plan + find + publish
  check) and the whole command's wall time;
- with --ray: the same prepare with prepare.runner=ray on a Ray cluster of two nodes on this
  machine (Ray's cluster_utils, half of the cores each), writing to a store directory of its
  own: its shards compared byte for byte with the process pool's, and its tokenizing time
  against the pool's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FILE_BYTES = 64 * 2**20
VOCAB_SIZE = 16384


def parse_size(text: str) -> int:
    from core.config import parse_bytes

    return parse_bytes(text)


# -- the corpus -----------------------------------------------------------------------------

def generate_corpus(directory: Path, size: int, seed: int = 0, processes: int = 1) -> int:
    """JSON Lines files of documents until `size` bytes; returns the bytes written.

    Files of FILE_BYTES each, written by up to `processes` processes at once (a 500 MB corpus
    took 46 s in one), every file drawing from the same vocabulary of words."""
    directory.mkdir(parents=True, exist_ok=True)
    shares = [(directory / f"part-{index:05d}.jsonl", min(FILE_BYTES, size - offset), seed, index)
              for index, offset in enumerate(range(0, size, FILE_BYTES))]
    if processes > 1 and len(shares) > 1:
        with multiprocessing.get_context("spawn").Pool(min(processes, len(shares))) as pool:
            return sum(pool.starmap(_generate_file, shares))
    return sum(_generate_file(*share) for share in shares)


def _generate_file(path: Path, size: int, seed: int, index: int) -> int:
    words_rng = np.random.default_rng(seed)  # the same words in every file
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(words_rng.choice(letters, size=int(n))) for n in words_rng.integers(1, 11, size=30000)]
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    rng = np.random.default_rng([seed, index])
    written = 0
    with open(path, "w") as f:
        while written < size:
            # A batch of documents at a time: numpy draws the words, Python joins them.
            lengths = rng.integers(90, 900, size=256)  # ~0.5-5 kB of text each
            picks = rng.choice(len(words), size=int(lengths.sum()), p=zipf)
            start = 0
            lines = []
            for n in lengths:
                text = " ".join(words[i] for i in picks[start:start + n])
                start += n
                lines.append(json.dumps({"text": text, "id": index}) + "\n")
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk)
    return written


def corpus_texts(directory: Path):
    for path in sorted(directory.glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                yield json.loads(line)["text"]


# -- measuring a command --------------------------------------------------------------------

def run_measured(cmd: list[str], env: dict, cwd: Path) -> dict:
    """Run `cmd`; its wall time, peak summed RSS of its process tree, and block writes."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak, at_peak = [0], [[]]

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root] + root.children(recursive=True)
                sizes = []
                for p in tree:
                    try:
                        sizes.append((p.memory_info().rss, p))
                    except psutil.Error:
                        pass
                if sum(rss for rss, _ in sizes) > peak[0]:  # names only then: sampling is cheap
                    peak[0] = sum(rss for rss, _ in sizes)
                    at_peak[0] = sorted(((rss, _name(p)) for rss, p in sizes), reverse=True)
            except psutil.Error:
                pass
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.communicate()[0].decode(errors="replace")
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-4000:]}")
    written = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock - before) * 512
    return {"wall_s": wall, "peak_rss": peak[0], "written": written, "output": output,
            "at_peak": [f"{rss / 2**20:.0f} MiB {what}" for rss, what in at_peak[0]]}


def _name(process) -> str:
    try:
        return " ".join(process.cmdline()[1:4])[:80]
    except Exception:  # gone since its size was read
        return "?"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# -- baselines ------------------------------------------------------------------------------

def _lines_in(path: str, start: int, end: int):
    """The lines of `path` that begin in bytes [start, end)."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line under way at `start` belongs to the range before
        while f.tell() < end:
            line = f.readline()
            if not line:
                return
            yield line


def _encode_ranges(args: tuple[str, list[tuple[str, int, int]]]) -> int:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tokenizer_path, ranges = args
    tokenizer = Tokenizer.from_file(tokenizer_path)
    n, batch = 0, []
    for path, start, end in ranges:
        for line in _lines_in(path, start, end):
            batch.append(json.loads(line)["text"])
            if len(batch) == 1024:
                n += sum(len(e.ids) + 1 for e in tokenizer.encode_batch(batch, add_special_tokens=False))
                batch = []
    if batch:
        n += sum(len(e.ids) + 1 for e in tokenizer.encode_batch(batch, add_special_tokens=False))
    return n


def equal_byte_shares(files: list[str], parts: int) -> list[list[tuple[str, int, int]]]:
    """The files cut into `parts` shares of equal bytes, as (path, start, end) ranges: every
    core gets the same work however few files there are (8 files of 64 MB on 16 cores would
    leave half the cores idle if files were dealt whole)."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    shares: list[list[tuple[str, int, int]]] = [[] for _ in range(parts)]
    offset = 0
    for path, size in zip(files, sizes):
        for i in range(parts):
            lo, hi = total * i // parts, total * (i + 1) // parts
            start, end = max(lo, offset), min(hi, offset + size)
            if start < end:
                shares[i].append((path, start - offset, end - offset))
        offset += size
    return shares


def raw_encode_batch(tokenizer_path: Path, corpus: Path, cores: int) -> dict:
    """encode_batch on every document, one process per core, each on an equal byte share."""
    files = sorted(str(p) for p in corpus.glob("*.jsonl"))
    shares = [(str(tokenizer_path), ranges) for ranges in equal_byte_shares(files, cores)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        tokens = sum(pool.map(_encode_ranges, shares))
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


# The function datasets.map runs on each batch. "tokenizers": the lean one, `tokenizers`'
# encode_batch with the EOS appended; "transformers": the recipe of transformers'
# examples/pytorch/language-modeling/run_clm.py, `tokenizer(examples["text"])` through a fast
# tokenizer (input_ids and attention_mask; the EOS is counted, not stored).
_MAP_ENCODE = {
    "tokenizers": """
from tokenizers import Tokenizer
tok = Tokenizer.from_file({path!r})
def encode(batch):
    return {{"ids": [e.ids + [0] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}}
def count(ids):
    return len(ids)
""",
    "transformers": """
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast(tokenizer_file={path!r})
def encode(batch):
    return tok(batch["text"])
def count(ids):
    return len(ids) + 1
""",
}


def datasets_map(tokenizer_path: Path, corpus: Path, cores: int, cache: Path,
                 encoder: str = "tokenizers") -> dict:
    """`datasets.load_dataset` + `map(batched=True, num_proc=cores)`, the usual recipe, with
    the batch function `_MAP_ENCODE[encoder]`."""
    column = "ids" if encoder == "tokenizers" else "input_ids"
    code = f"""
import os, time, json
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import datasets
datasets.disable_progress_bars()
{_MAP_ENCODE[encoder].format(path=str(tokenizer_path))}
files = sorted(str(p) for p in __import__("pathlib").Path({str(corpus)!r}).glob("*.jsonl"))
start = time.perf_counter()
ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir={str(cache)!r})
out = ds.map(encode, batched=True, num_proc={cores}, remove_columns=ds.column_names)
wall = time.perf_counter() - start  # counting the tokens (to check the work) is not map's time
tokens = sum(count(x) for batch in out.iter(batch_size=10000) for x in batch[{column!r}])
print(json.dumps({{"tokens": tokens, "wall_s": wall}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    shutil.rmtree(cache, ignore_errors=True)
    return measured | {"tokens_per_s": measured["tokens"] / measured["wall_s"]}


# A flow run that does nothing: Prefect's temporary server creates its database.
_EMPTY_FLOW_RUN = "from prefect import flow\nflow(name='create-prefect-home')(lambda: None)()\n"


# -- one size -------------------------------------------------------------------------------

def goodput_command() -> list[str]:
    """The `goodput` console script installed beside this Python, or the same entry point as a
    module where the repository is not installed (the lent GPU machine's wheels)."""
    script = Path(sys.executable).with_name("goodput")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]


def bench_size(label: str, size: int, work: Path, cores: int, map_max: int, ray: bool) -> dict:
    from core.config import load_config
    from goodput.data import prepare as prep
    from storage.store import store_from_config

    corpus = work / f"corpus-{label}"
    if not corpus.exists():
        t = time.perf_counter()
        input_bytes = generate_corpus(corpus, size, processes=cores)
        print(f"[{label}] generated {input_bytes / 1e6:.0f} MB in {time.perf_counter() - t:.0f}s", flush=True)
    input_bytes = dir_bytes(corpus)
    root = work / f"prep-{label}"
    shutil.rmtree(root, ignore_errors=True)
    overrides = [f"data.source={corpus}", f"data.data_dir={root / 'data'}",
                 f"storage.uri={root / 'store'}", f"run.runs_dir={root / 'runs'}",
                 f"run.run_id=bench-{label}", f"tokenizer.vocab_size={VOCAB_SIZE}",
                 f"prepare.workers={cores}", "prepare.progress=false"]
    (root / "prefect").mkdir(parents=True)
    # A new database's first start (its migrations) can pass Prefect's 20 s on a busy
    # machine: the commands allow 120 s (flows/cli.py), and so does the empty flow run.
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               PREFECT_HOME=str(root / "prefect"))
    home_created = run_measured([sys.executable, "-c", _EMPTY_FLOW_RUN], env, REPO)["written"]
    first = run_measured([*goodput_command(), "prepare", *overrides], env, REPO)
    summary = json.loads((root / "runs" / f"bench-{label}" / "summary.json").read_text())["prepare"]
    config = load_config(None, overrides)
    plan = prep.plan_dataset(config)
    output = dir_bytes(plan.dir) + dir_bytes(root / "store")
    prefect_home = dir_bytes(root / "prefect")  # the temporary server's database, logs
    tokens = sum(summary["tokens"].values())
    row = {"size": label, "input_bytes": input_bytes, "files": len(list(corpus.glob("*.jsonl"))),
           "tokens": tokens, "wall_s": first["wall_s"], "tokenize_s": summary["tokenize_s"],
           "tokens_per_s": tokens / summary["tokenize_s"], "peak_rss": first["peak_rss"],
           "written": first["written"], "output_bytes": output, "at_peak": first["at_peak"],
           "prefect_home_bytes": prefect_home, "prefect_home_created_bytes": home_created,
           "written_beyond_output": max(0, first["written"] - output)}
    # Where the tokenizing time went: the unit processes' start, the units, the gaps between.
    from benchmarks.prepare_timeline import timeline

    row["unit_timeline"] = timeline(root / "prefect")
    print(f"[{label}] units: {json.dumps(row['unit_timeline'])}", flush=True)
    print(f"[{label}] prepare: {first['wall_s']:.0f}s, {tokens:,} tokens, "
          f"{row['tokens_per_s']:,.0f} tokens/s, peak RSS {first['peak_rss'] / 2**20:.0f} MiB, "
          f"written {first['written'] / 1e6:.0f} MB (output {output / 1e6:.0f} MB, Prefect's "
          f"home {prefect_home / 1e6:.0f} MB, creating it wrote {home_created / 1e6:.0f} MB "
          f"before); at the peak: "
          f"{'; '.join(first['at_peak'])}", flush=True)

    # The no-op rerun: the library's decision, then the whole command.
    store = store_from_config(config.storage)
    t = time.perf_counter()
    plan = prep.plan_dataset(config)
    manifest = prep.find_prepared(plan, store)
    prep.publish(plan, manifest, store)
    row["noop_decide_s"] = time.perf_counter() - t
    row["noop_command_s"] = run_measured([*goodput_command(), "prepare", *overrides], env, REPO)["wall_s"]
    print(f"[{label}] no-op rerun: decided in {row['noop_decide_s']:.2f}s, command "
          f"{row['noop_command_s']:.1f}s", flush=True)

    if size <= map_max:
        raw = raw_encode_batch(plan.tokenizer_path, corpus, cores)
        row["raw_tokens_per_s"] = raw["tokens_per_s"]
        row["vs_raw"] = row["tokens_per_s"] / raw["tokens_per_s"]
        mapped = datasets_map(plan.tokenizer_path, corpus, cores, work / "hf-cache")
        row["map_tokens_per_s"] = mapped["tokens_per_s"]
        row["vs_map"] = row["tokens_per_s"] / mapped["tokens_per_s"]
        recipe = datasets_map(plan.tokenizer_path, corpus, cores, work / "hf-cache", "transformers")
        row["recipe_tokens_per_s"] = recipe["tokens_per_s"]
        row["vs_recipe"] = row["tokens_per_s"] / recipe["tokens_per_s"]
        if not raw["tokens"] == mapped["tokens"] == recipe["tokens"] == tokens:
            print(f"[{label}] NOT THE SAME WORK: tokens {tokens:,} (prepare), {raw['tokens']:,} "
                  f"(raw), {mapped['tokens']:,} (map), {recipe['tokens']:,} (run_clm.py's map)")
        print(f"[{label}] raw encode_batch {raw['tokens_per_s']:,.0f} tokens/s "
              f"({raw['tokens']:,} tokens), datasets.map {mapped['tokens_per_s']:,.0f}, "
              f"datasets.map as run_clm.py {recipe['tokens_per_s']:,.0f}: goodput "
              f"{row['vs_raw']:.2f}x raw, {row['vs_map']:.2f}x map, {row['vs_recipe']:.2f}x "
              "run_clm.py's map", flush=True)
    if ray:
        row |= bench_ray(label, overrides, env, root, cores, plan, manifest, summary["tokenize_s"])
    shutil.rmtree(root, ignore_errors=True)
    return row


def bench_ray(label: str, overrides: list[str], env: dict, root: Path, cores: int, plan,
              manifest, pool_tokenize_s: float) -> dict:
    """prepare.runner=ray on two local Ray nodes: the same bytes, and the time it takes."""
    from ray.cluster_utils import Cluster

    from storage.store import open_store

    half = max(1, cores // 2)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": half, "include_dashboard": False})
    cluster.add_node(num_cpus=max(1, cores - half))
    cluster.wait_for_nodes()
    try:
        store_dir = root / "ray-store"
        ray_overrides = [o for o in overrides if not o.startswith(("storage.uri=", "run.run_id=",
                                                                   "prepare.workers=", "data.data_dir="))]
        ray_overrides += [f"storage.uri={store_dir}", f"run.run_id=bench-{label}-ray",
                          f"data.data_dir={root / 'ray-data'}",
                          "prepare.runner=ray", f"prepare.ray_address={cluster.address}"]
        wall = run_measured([*goodput_command(), "prepare", *ray_overrides], env, REPO)["wall_s"]
    finally:
        cluster.shutdown()
    summary = json.loads((root / "runs" / f"bench-{label}-ray" / "summary.json").read_text())["prepare"]
    store, prefix = open_store(str(store_dir)), f"datasets/{manifest.dataset_id}"
    listed = [s.path for shards in manifest.splits.values() for s in shards]
    same = all(store.get_bytes(f"{prefix}/{rel}") == (plan.dir / rel).read_bytes() for rel in listed)
    nodes = len({w.split("Ray node ")[-1] for w in summary["workers"]})
    print(f"[{label}] ray on 2 local nodes: wall {wall:.0f}s, tokenizing {summary['tokenize_s']:.1f}s "
          f"against {pool_tokenize_s:.1f}s in the process pool ({summary['tokenize_s'] / pool_tokenize_s:.2f}x); "
          f"units ran on {nodes} nodes; {len(listed)} shards {'byte-equal' if same else 'DIFFERENT'}",
          flush=True)
    return {"ray_wall_s": wall, "ray_tokenize_s": summary["tokenize_s"], "ray_nodes": nodes,
            "ray_vs_pool": summary["tokenize_s"] / pool_tokenize_s, "ray_same_shards": same}


def print_table(rows: list[dict]) -> None:
    print("\n| corpus | files | tokens | prepare wall (s) | tokens/s | vs raw encode_batch | vs datasets.map "
          "| vs run_clm.py's map | peak RSS (MiB) | written beyond output (% of input) "
          "| creating Prefect's home (MB, once) | no-op decision (s) | no-op command (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = lambda key: f"{r[key]:.2f}x" if key in r else "–"  # noqa: E731
        print(f"| {r['size']} | {r['files']} | {r['tokens']:,} | {r['wall_s']:.0f} | "
              f"{r['tokens_per_s']:,.0f} | {ratio('vs_raw')} | {ratio('vs_map')} | {ratio('vs_recipe')} | "
              f"{r['peak_rss'] / 2**20:,.0f} | "
              f"{100 * r['written_beyond_output'] / r['input_bytes']:.1f}% | "
              f"{r['prefect_home_created_bytes'] / 1e6:.1f} | "
              f"{r['noop_decide_s']:.2f} | {r['noop_command_s']:.1f} |")
    if any("ray_tokenize_s" in r for r in rows):
        print("\n| corpus | Ray (2 local nodes) tokenizing (s) | process pool (s) | Ray / pool | nodes used "
              "| shards |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['size']} | {r['ray_tokenize_s']:.1f} | {r['tokenize_s']:.1f} | "
                  f"{r['ray_vs_pool']:.2f}x | {r['ray_nodes']} | "
                  f"{'byte-equal' if r['ray_same_shards'] else 'DIFFERENT'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["100MB", "500MB", "2GB"])
    parser.add_argument("--workdir", type=Path, help="keep corpora here (default: a temporary dir)")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--map-max", default="500MB",
                        help="compare with raw encode_batch and datasets.map up to this size")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--ray", action="store_true",
                        help="also prepare each corpus on a two-node local Ray cluster")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    rows = [bench_size(s, parse_size(s), work, args.cores, parse_size(args.map_max), args.ray)
            for s in args.sizes]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
