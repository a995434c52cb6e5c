"""Downstream evaluation cost (issue 24): what a five-task lm-eval evaluation of a checkpoint
takes, and what evaluations running beside training cost the trainer.

    python benchmarks/eval_bench.py [--model 100m] [--limit 200] [--out FILE]
    python benchmarks/eval_bench.py --part eval --model 20m --limit 50 --tasks hellaswag,piqa
    python benchmarks/eval_bench.py --part train [--train-steps 80] [--checkpoint-every 10] \
        [--every-validated 2] [--train-limit 20]
    python benchmarks/eval_bench.py --model tiny --limit 8 --train-steps 24 --train-model tiny  # quick

The hub's datasets cannot be downloaded here, so the five tasks are local lm-eval task YAMLs
(eval.task_dir) shaped like the real ones, with the real YAMLs' fields, templates and metrics:

- hellaswag: 4-way multiple choice, a 40-word context, 25-word endings (acc, acc_norm);
- arc_easy: 4-way multiple choice, "Question: ...\\nAnswer:", 1-4-word answers (acc, acc_norm);
- piqa: 2-way multiple choice, a 10-word goal, 20-word solutions (acc, acc_norm);
- lambada: cloze, the last word of a 75-word passage (perplexity, acc);
- winogrande: 2-way, partial scoring as lm-eval's winogrande: the sentence up to the blank
  with each option is the context, the rest of the sentence the scored continuation (acc).

Their text is cut from the built-in corpus (the documentation Python ships, as `data.source:
builtin` prepares it): true continuations against spans of other documents. The dataset
(tokenizer and validation split) is prepared by the project (goodput.data.prepare).

Part `eval`: a checkpoint of the --model size (weights as initialised, in the trainer's
checkpoint format: DCP + manifest; evaluation cost does not depend on the weights) is
evaluated through goodput.evaluation.evaluate, what the evaluate flow's evaluate-checkpoint
task and `goodput evaluate` run: a `python -m training.evaluate` process (held-out loss on
one batch, no samples, then eval.tasks through lm-eval). Once with no task (the fixed cost:
process start, imports, checkpoint load, held-out loss), once per task alone, and once with
all of them (the total a user waits for). Items and requests are lm-eval's own
(Task.build_all_requests at eval.limit); tokens are the dataset tokenizer's count of each
request's context and continuation.

Part `train`: the same short training run of --train-model through the train flow
(flows.train.train: torchrun, validation, upload, and with eval.every_validated the
evaluate-validated task, a `python -m training.evaluate --background` process at the lowest
CPU priority), once with eval.every_validated=0 and once with it on, over the local tasks at
--train-limit items each. The trainer is one worker of one thread (parallelism.nproc_per_node
=1, launch.env OMP_NUM_THREADS=1), leaving the other core to the evaluation (itself one
thread, --eval-threads). Per step: the trainer's step_time_s and the interval between
consecutive metrics records (the whole loop iteration); a step overlaps an evaluation when
that interval meets the time an evaluate-validated task ran (from the Prefect API). Printed:
the median step time with evaluations off, with them on (all steps, and the steps taken
while one ran), their ratios, and how many evaluations overlapped training.

Part `backends` (issue 37): each task under lm-eval's own `hf` model (on the checkpoint
exported by `goodput export --format hf`), ProjectLM before issue 37 (every request whole),
ProjectLM now (an item's requests packed) in fp32 and under bf16 autocast, in this one
process: seconds, scores, and the largest difference of a request's log-likelihood between
them. `--device cuda` runs all four on one GPU, where bf16 is what `eval.precision=auto`
picks (benchmarks/device_session.sh). `--float64-reference` also scores each task once with
the path before in float64 (untimed) and reports how far each fp32 path is from it: which
path's rounding a difference between two of them is.

Asserts nothing. Markdown tables on stdout, for benchmarks/RESULTS.md; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {  # dim, layers, heads
    "100m": (768, 12, 12),
    "20m": (384, 6, 6),
    "tiny": (64, 2, 4),
}
VOCAB = 8192
TASKS = {  # short name -> (local task name, shape)
    "hellaswag": ("local_hellaswag", "4-way MC, long endings"),
    "arc_easy": ("local_arc_easy", "4-way MC, short answers"),
    "piqa": ("local_piqa", "2-way MC"),
    "lambada": ("local_lambada", "cloze, last word"),
    "winogrande": ("local_winogrande", "2-way, partial scoring"),
}


# --- the tasks ---------------------------------------------------------------------------

class Words:
    """Word spans of the built-in corpus: a document's consecutive words, or another's."""

    def __init__(self, corpus: Path, seed: int = 0):
        docs = (json.loads(line)["text"].split() for line in corpus.read_text().splitlines())
        self.docs = [d for d in docs if len(d) >= 120]
        self.rng = random.Random(seed)

    def span(self, n: int) -> list[str]:
        doc = self.rng.choice(self.docs)
        start = self.rng.randrange(0, len(doc) - n)
        return doc[start:start + n]

    def other(self, n: int) -> str:
        return " ".join(self.span(n))


def task_items(words: Words, task: str, count: int) -> list[dict]:
    """`count` items of `task` in the fields of the real task's dataset."""
    rng, items = words.rng, []
    for _ in range(count):
        if task == "hellaswag":  # as lm-eval's hellaswag process_docs leaves them
            span = words.span(65)
            choices = [words.other(25) for _ in range(3)]
            label = rng.randrange(4)
            choices.insert(label, " ".join(span[40:]))
            items.append({"query": " ".join(span[:40]), "choices": choices, "label": str(label)})
        elif task == "arc_easy":
            length = rng.randint(1, 4)
            span = words.span(22 + length)
            texts = [words.other(rng.randint(1, 4)) for _ in range(3)]
            label = rng.randrange(4)
            texts.insert(label, " ".join(span[22:]))
            items.append({"question": " ".join(span[:22]) + "?", "answerKey": "ABCD"[label],
                          "choices": {"text": texts, "label": list("ABCD")}})
        elif task == "piqa":
            span = words.span(30)
            solutions = [" ".join(span[10:]), words.other(20)]
            label = rng.randrange(2)
            if label:
                solutions.reverse()
            items.append({"goal": " ".join(span[:10]), "sol1": solutions[0], "sol2": solutions[1],
                          "label": label})
        elif task == "lambada":
            items.append({"text": words.other(75)})
        elif task == "winogrande":
            span = words.span(22)
            blank = rng.randrange(6, 15)
            options = [span[blank], words.span(1)[0]]
            answer = rng.randrange(2)
            if answer:
                options.reverse()
            sentence = " ".join(span[:blank] + ["_"] + span[blank + 1:])
            items.append({"sentence": sentence, "option1": options[0], "option2": options[1],
                          "answer": str(answer + 1)})
    return items


def task_yaml(task: str, data: Path) -> str:
    """The real task's YAML (lm-eval 0.4), reading `data` instead of the hub."""
    name = TASKS[task][0]
    split = {"hellaswag": "validation", "arc_easy": "test", "piqa": "validation",
             "lambada": "test", "winogrande": "validation"}[task]
    head = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    {split}: {data}\n"
            f"{split}_split: {split}\n")
    mc = ("metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
          "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")
    body = {
        "hellaswag": 'output_type: multiple_choice\ndoc_to_text: "{{query}}"\n'
                     'doc_to_target: "{{label}}"\ndoc_to_choice: "choices"\n' + mc,
        "arc_easy": 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
                    'doc_to_target: "{{choices.label.index(answerKey)}}"\n'
                    'doc_to_choice: "{{choices.text}}"\n' + mc,
        "piqa": 'output_type: multiple_choice\ndoc_to_text: "Question: {{goal}}\\nAnswer:"\n'
                'doc_to_target: label\ndoc_to_choice: "{{[sol1, sol2]}}"\n' + mc,
        "lambada": "output_type: loglikelihood\n"
                   "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                   "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
                   "metric_list:\n  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}\n"
                   "  - {metric: acc, aggregation: mean, higher_is_better: true}\n",
        "winogrande": "output_type: multiple_choice\n"
                      "doc_to_text: !function preprocess_winogrande.doc_to_text\n"
                      "doc_to_target: !function preprocess_winogrande.doc_to_target\n"
                      "doc_to_choice: !function preprocess_winogrande.doc_to_choice\n"
                      "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n",
    }[task]
    return head + body


WINOGRANDE_FUNCTIONS = '''\
# lm-eval's tasks/winogrande/preprocess_winogrande.py
def doc_to_text(doc):
    answer_to_num = {"1": 0, "2": 1}
    return answer_to_num[doc["answer"]]


def doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    options = [doc["option1"], doc["option2"]]
    return [doc["sentence"][:idx] + opt for opt in options]
'''


def write_tasks(folder: Path, corpus: Path, count: int) -> Path:
    """The five local tasks, `count` items each, as eval.task_dir."""
    folder.mkdir(parents=True, exist_ok=True)
    words = Words(corpus)
    for task in TASKS:
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in task_items(words, task, count)))
        (folder / f"{TASKS[task][0]}.yaml").write_text(task_yaml(task, data.resolve()))
    (folder / "preprocess_winogrande.py").write_text(WINOGRANDE_FUNCTIONS)
    return folder


def request_counts(task_dir: Path, tasks: list[str], limit: int, tokenizer) -> dict[str, dict]:
    """lm-eval's items and requests per task at `limit`, and the tokens the requests hold."""
    from training.downstream import load_tasks

    _, built = load_tasks([TASKS[t][0] for t in tasks], str(task_dir))
    counts = {}
    for task, lm_task in zip(tasks, built):
        lm_task.build_all_requests(limit=limit, rank=0, world_size=1)
        docs = {inst.doc_id for inst in lm_task.instances}
        tokens = sum(len(tokenizer.encode(part).ids) for inst in lm_task.instances for part in inst.args
                     if isinstance(part, str))
        counts[task] = {"items": len(docs), "requests": len(lm_task.instances), "tokens": tokens}
    return counts


# --- shared set-up -----------------------------------------------------------------------

def base_overrides(workdir: Path, model: str) -> list[str]:
    dim, layers, heads = MODELS[model]
    return [f"run.runs_dir={workdir / 'runs'}", f"data.data_dir={workdir / 'data'}",
            f"storage.uri={workdir / 'store'}", "data.source=builtin",
            f"tokenizer.vocab_size={VOCAB}", f"model.dim={dim}", f"model.n_layers={layers}",
            f"model.n_heads={heads}", "model.max_seq_len=512", "tracking.tensorboard=false"]


def prepared_dataset(workdir: Path) -> Path:
    """The built-in corpus prepared by the project (tokenizer, shards; a few seconds once)."""
    from core.config import load_config
    from goodput.data.prepare import dataset_for_training, prepare_dataset
    from storage.store import store_from_config

    config = load_config(None, base_overrides(workdir, "tiny"))
    prepare_dataset(config)
    return dataset_for_training(config, store_from_config(config.storage))


def corpus_file(workdir: Path) -> Path:
    from goodput.data.corpus import build_builtin_corpus

    return build_builtin_corpus(workdir / "corpus")


# --- part eval -----------------------------------------------------------------------------

def write_checkpoint(config, dataset_dir: Path, path: Path) -> int:
    """An initialised model of `config.model` saved as the trainer saves one; its parameters."""
    import torch.distributed.checkpoint as dcp

    from storage.manifests import CheckpointManifest, DatasetManifest, list_files
    from training.model import Transformer, model_args_from_config

    manifest = DatasetManifest.load(dataset_dir)
    model = Transformer(model_args_from_config(config.model, manifest.vocab_size), 0)
    if not (path / "manifest.json").is_file():
        dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(path),
                 no_dist=True)
        CheckpointManifest(step=1, tokens_seen=0, files=list_files(path), world_size=1, layout={},
                           config_hash="", dataset_id=manifest.dataset_id,
                           model_args=vars(model.args), seq_len=config.training.seq_len,
                           created_at=time.time()).save(path)
    return sum(p.numel() for p in model.parameters())


def evaluate_once(config, checkpoint: Path, dataset_dir: Path) -> dict:
    """goodput.evaluation.evaluate (the evaluate flow's path), never reusing a saved report."""
    from goodput.evaluation import evaluate, report_path

    report_path(config, checkpoint).unlink(missing_ok=True)
    started = time.perf_counter()
    report = evaluate(config, checkpoint, dataset_dir)
    return {"seconds": time.perf_counter() - started, "in_process_s": report.wall_time_s,
            "scores": {t: {m: v for m, v in s.items() if not m.endswith("_stderr")}
                       for t, s in report.downstream.items()}}


def eval_cost(args, workdir: Path, dataset_dir: Path, task_dir: Path) -> dict:
    from core.config import load_config
    from training.tokenizer import read_tokenizer

    tasks = args.tasks
    overrides = [*base_overrides(workdir, args.model), "run.run_id=evalbench",
                 f"eval.task_dir={task_dir}", f"eval.limit={args.limit}",
                 f"eval.batch_size={args.batch_size}", "eval.max_batches=1", "eval.num_samples=0",
                 "training.seq_len=256"]

    def config_for(names: list[str]):
        return load_config(None, [*overrides, f"eval.tasks=[{', '.join(TASKS[t][0] for t in names)}]"])

    config = config_for([])
    checkpoint = workdir / f"checkpoint-{args.model}" / "step-00000001"
    params = write_checkpoint(config, dataset_dir, checkpoint)
    counts = request_counts(task_dir, tasks, args.limit, read_tokenizer(dataset_dir / "tokenizer.json"))
    threads = os.environ.get("OMP_NUM_THREADS") or f"{os.cpu_count()} (OMP_NUM_THREADS unset)"
    print(f"\n## eval: {args.model} ({params / 1e6:.1f}M parameters), eval.limit={args.limit}, "
          f"eval.batch_size={args.batch_size}; load before {os.getloadavg()[0]:.2f}", flush=True)
    fixed = evaluate_once(config, checkpoint, dataset_dir)
    print(f"  no task: {fixed['seconds']:.1f} s", flush=True)
    rows = {}
    for task in tasks:
        rows[task] = {**counts[task], **evaluate_once(config_for([task]), checkpoint, dataset_dir)}
        rows[task]["beyond_fixed_s"] = rows[task]["seconds"] - fixed["seconds"]
        print(f"  {task}: {rows[task]['seconds']:.1f} s", flush=True)
    together = evaluate_once(config_for(tasks), checkpoint, dataset_dir)
    load = os.getloadavg()[0]
    print(f"  all {len(tasks)}: {together['seconds']:.1f} s; load after {load:.2f}", flush=True)
    return {"model": args.model, "params": params, "limit": args.limit, "batch_size": args.batch_size,
            "eval_threads": threads, "fixed": fixed, "tasks": rows, "together": together, "load_1min_after": load}


def eval_table(result: dict) -> str:
    fixed, rows, together = result["fixed"], result["tasks"], result["together"]
    lines = [f"Model {result['model']} ({result['params'] / 1e6:.1f}M parameters), eval.limit="
             f"{result['limit']}, eval.batch_size={result['batch_size']}, evaluation threads "
             f"{result['eval_threads']}; load (1 min) "
             f"{result['load_1min_after']:.2f} at the end",
             "",
             "| task (local, shaped like) | shape | items | requests | tokens | evaluation alone, s "
             "| beyond the fixed cost, s | ms per request |",
             "|---|---|---|---|---|---|---|---|",
             f"| (no task: the fixed cost) | process, imports, checkpoint, held-out loss | | | | "
             f"{fixed['seconds']:.1f} | | |"]
    for task, row in rows.items():
        lines.append(f"| {task} | {TASKS[task][1]} | {row['items']} | {row['requests']:,} | "
                     f"{row['tokens']:,} | {row['seconds']:.1f} | {row['beyond_fixed_s']:.1f} | "
                     f"{1e3 * row['beyond_fixed_s'] / row['requests']:.0f} |")
    items = sum(r["items"] for r in rows.values())
    requests = sum(r["requests"] for r in rows.values())
    tokens = sum(r["tokens"] for r in rows.values())
    lines.append(f"| **all {len(rows)} in one evaluation** | | {items} | {requests:,} | {tokens:,} | "
                 f"**{together['seconds']:.1f}** | {together['seconds'] - fixed['seconds']:.1f} | "
                 f"{1e3 * (together['seconds'] - fixed['seconds']) / requests:.0f} |")
    lines.append("")
    lines.append("Scores (untrained weights: chance level): " + "; ".join(
        f"{task} " + ", ".join(f"{m} {v:.3g}" for m, v in s.items())
        for task, s in together["scores"].items()))
    return "\n".join(lines)


# --- part backends ---------------------------------------------------------------------------

def whole_requests_lm(model, tokenizer, eos_id: int, batch_size: int, device, float64: bool = False):
    """ProjectLM as it was before issue 37, the baseline of part backends and of
    tests/test_downstream.py: every request scored whole in its own row (a multiple-choice
    item's context read once per choice), rolling texts one at a time.

    `float64`: the same scoring with a float64 copy of the model, its softmax and sums in
    float64 too: the reference that the fp32 paths' rounding is measured against."""
    import copy

    import torch
    import torch.nn.functional as F
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from training.downstream import _make_lm_class

    dtype = torch.float64 if float64 else torch.float32
    if float64:
        model = copy.deepcopy(model).double()

    class WholeRequestsLM(_make_lm_class()):
        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            results = [None] * len(requests)
            order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
            for first in range(0, len(order), self.batch_size):
                rows = []
                for i in order[first:first + self.batch_size]:
                    _, context, continuation = requests[i]
                    whole = (context + continuation)[-(self.max_length + 1):]
                    scored = continuation[-(len(whole) - 1):]
                    rows.append((i, whole[:-1], scored))
                width = max(len(inputs) for _, inputs, _ in rows)
                batch = torch.zeros(len(rows), width, dtype=torch.long)
                for r, (_, inputs, _) in enumerate(rows):
                    batch[r, :len(inputs)] = torch.tensor(inputs)
                logprobs = F.log_softmax(self.model(batch.to(self.device)).to(dtype), dim=-1)
                for r, (i, inputs, continuation) in enumerate(rows):
                    n = len(continuation)
                    scored = logprobs[r, len(inputs) - n:len(inputs)]
                    target = torch.tensor(continuation, device=scored.device)
                    results[i] = (scored.gather(1, target[:, None]).sum().item(),
                                  bool((scored.argmax(dim=-1) == target).all()))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            out = []
            for request in requests:
                (text,) = request.args
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]
                out.append(sum(score for score, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows])))
            return out

    return WholeRequestsLM(model, tokenizer, eos_id, batch_size, device)


BACKENDS = {  # name -> what it is, for the table
    "lm-eval hf": "lm-eval's own `hf` model on the `goodput export --format hf` copy",
    "goodput before": "ProjectLM before issue 37: every request whole",
    "goodput": "ProjectLM: an item's requests packed, context once",
    "goodput bf16": "the same under bf16 autocast (eval.precision=bf16; what 'auto' picks on a CPU "
                    "with AVX512-BF16 or AMX, and on a GPU)",
}
# --float64-reference: the path before in float64, untimed, what each backend's rounding is
# measured against (the "within 1e-4 of today's path" meets today's own fp32 error).
REFERENCE = "float64 reference"
REFERENCE_COMPARED = ("goodput", "goodput before", "lm-eval hf")  # the fp32 paths


def export_hf(checkpoint: Path, dataset_dir: Path, out: Path) -> Path:
    """The checkpoint as a transformers model, through the CLI a user runs (its module: where
    the repository is not installed, as on a lent GPU machine, there is no `goodput` script)."""
    import subprocess

    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "flows.cli", "export", str(checkpoint), "--format", "hf",
                        "--out", str(out), "--tokenizer", str(dataset_dir)], check=True, cwd=REPO)
    return out


def run_backend(name: str, task_names: list[str], manager, args, checkpoint: Path, hf_dir: Path,
                dataset_dir: Path) -> dict:
    """One lm-eval evaluation: the model loaded, then lm-eval's simple_evaluate; wall time of
    both, the scores and each request's log-likelihood (task -> doc -> list)."""
    import torch
    from lm_eval import evaluator

    device = torch.device(args.device)
    started = time.perf_counter()
    if name == "lm-eval hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(hf_dir), device=args.device, batch_size=args.batch_size, dtype="float32")
    else:
        from storage.manifests import DatasetManifest
        from training.checkpoint.reader import load_model
        from training.downstream import project_lm
        from training.tokenizer import read_tokenizer

        model, _ = load_model(checkpoint, device)
        tokenizer = read_tokenizer(dataset_dir / "tokenizer.json")
        eos = DatasetManifest.load(dataset_dir).eos_id
        if name in ("goodput before", REFERENCE):
            lm = whole_requests_lm(model.eval(), tokenizer, eos, args.batch_size, device,
                                   float64=name == REFERENCE)
        else:
            lm = project_lm(model.eval(), tokenizer, eos, args.batch_size, device,
                            precision="bf16" if name == "goodput bf16" else "fp32")
    results = evaluator.simple_evaluate(
        model=lm, tasks=task_names, task_manager=manager, limit=args.limit, bootstrap_iters=0,
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    seconds = time.perf_counter() - started
    scores = {task: {k.split(",")[0]: v for k, v in values.items()
                     if "," in k and "stderr" not in k and isinstance(v, float)}
              for task, values in results["results"].items()}
    # lm-eval's own stderr of a mean (mean_stderr: the sample's standard deviation over
    # sqrt(n)), per accuracy metric; bootstrap_iters=0 leaves it out of `results`.
    stderrs = {task: {m: statistics.stdev(s[m] for s in samples) / len(samples) ** 0.5
                      for m in scores[task] if m.startswith("acc") and len(samples) > 1}
               for task, samples in results["samples"].items()}
    lls = {task: {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] if isinstance(
        s["filtered_resps"][0], (list, tuple)) else [float(x) for x in s["filtered_resps"]] for s in samples}
        for task, samples in results["samples"].items()}
    return {"seconds": seconds, "scores": scores, "stderrs": stderrs, "lls": lls}


def input_tokens(task_dir: Path, tasks: list[str], limit: int, dataset_dir: Path, max_length: int) -> dict:
    """Per task: the tokens the model reads for its requests, scoring each whole (as before) and
    packed by item (pack_requests)."""
    import torch

    from storage.manifests import DatasetManifest
    from training.downstream import load_tasks, pack_requests, project_lm
    from training.model import ModelArgs, Transformer
    from training.tokenizer import read_tokenizer

    tokenizer = read_tokenizer(dataset_dir / "tokenizer.json")
    with torch.device("meta"):
        model = Transformer(ModelArgs(vocab_size=VOCAB, max_seq_len=max_length))
    lm = project_lm(model, tokenizer, DatasetManifest.load(dataset_dir).eos_id, 1, torch.device("cpu"))
    _, built = load_tasks([TASKS[t][0] for t in tasks], str(task_dir))
    counts = {}
    for task, lm_task in zip(tasks, built):
        lm_task.build_all_requests(limit=limit, rank=0, world_size=1)
        pairs = [lm._encode_pair(*inst.args) for inst in lm_task.instances]
        whole = sum(min(len(c) + len(t), max_length + 1) - 1 for c, t in pairs)
        rows = pack_requests(pairs, [inst.doc_id for inst in lm_task.instances], max_length)
        counts[task] = {"items": len({inst.doc_id for inst in lm_task.instances}),
                        "requests": len(lm_task.instances), "tokens_whole": whole,
                        "tokens_packed": sum(len(row.tokens) for row in rows)}
    return counts


def compare_backends(args, workdir: Path, dataset_dir: Path, task_dir: Path) -> dict:
    """Each task alone, under each backend in turn (the order rotated every repeat), in this
    one process with the same torch threads."""
    import torch
    from core.config import load_config
    from training.downstream import task_manager_for

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(None, [*base_overrides(workdir, args.model), "training.seq_len=256"])
    checkpoint = workdir / f"checkpoint-{args.model}" / "step-00000001"
    params = write_checkpoint(config, dataset_dir, checkpoint)
    hf_dir = export_hf(checkpoint, dataset_dir, workdir / f"hf-{args.model}")
    names = [TASKS[t][0] for t in args.tasks]
    manager = task_manager_for(names, str(task_dir))
    counts = input_tokens(task_dir, args.tasks, args.limit, dataset_dir, config.model.max_seq_len)
    backends = list(BACKENDS)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.device == "cuda":  # CUDA's context and cuBLAS handle now, not in the first timing
        (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum().item()
    print(f"\n## backends: {args.model} ({params / 1e6:.1f}M parameters) on {device_name}, eval.limit="
          f"{args.limit}, batch size {args.batch_size}, torch threads {torch.get_num_threads()}; load "
          f"before {os.getloadavg()[0]:.2f}", flush=True)
    # Each task alone, then (where more than one) all of them in one evaluation, as a user runs
    # them: the model loaded and lm-eval set up once.
    together = ["all"] if len(args.tasks) > 1 else []
    runs: dict[str, dict[str, list]] = {t: {b: [] for b in backends} for t in args.tasks + together}
    for repeat in range(args.repeats):
        for n, task in enumerate(args.tasks + together):
            shift = (repeat + n) % len(backends)
            names = [TASKS[t][0] for t in args.tasks] if task == "all" else [TASKS[task][0]]
            for backend in backends[shift:] + backends[:shift]:
                run = run_backend(backend, names, manager, args, checkpoint, hf_dir, dataset_dir)
                runs[task][backend].append(run)
                print(f"  {task} / {backend}: {run['seconds']:.1f} s", flush=True)
    rows = {}
    if together:
        rows["all"] = {"seconds": {b: statistics.median(r["seconds"] for r in runs["all"][b]) for b in backends},
                       "all_seconds": {b: [r["seconds"] for r in runs["all"][b]] for b in backends}}
    for task in args.tasks:
        median = {b: statistics.median(r["seconds"] for r in runs[task][b]) for b in backends}
        name = TASKS[task][0]
        before, now, hf, bf16 = (runs[task][b][0] for b in ("goodput before", "goodput", "lm-eval hf",
                                                              "goodput bf16"))
        diffs = {f"{one} vs {other}": _max_ll_diff(first, second, name)
                 for one, first, other, second in (("goodput", now, "goodput before", before),
                                                   ("goodput", now, "lm-eval hf", hf),
                                                   ("goodput before", before, "lm-eval hf", hf))}
        rows[task] = {**counts[task], "seconds": median,
                      "all_seconds": {b: [r["seconds"] for r in runs[task][b]] for b in backends},
                      "scores": {b: runs[task][b][0]["scores"][name] for b in backends},
                      "stderrs": runs[task]["goodput"][0]["stderrs"].get(name, {}),
                      "max_ll_diff": diffs, "bf16_max_ll_diff": _max_ll_diff(bf16, now, name)}
        if args.float64_reference:
            reference = run_backend(REFERENCE, [name], manager, args, checkpoint, hf_dir, dataset_dir)
            print(f"  {task} / {REFERENCE}: {reference['seconds']:.1f} s (untimed in the tables)", flush=True)
            rows[task]["max_ll_error"] = {b: _max_ll_diff(runs[task][b][0], reference, name)
                                          for b in REFERENCE_COMPARED}
    return {"model": args.model, "params": params, "device": device_name, "limit": args.limit,
            "batch_size": args.batch_size, "threads": torch.get_num_threads(), "repeats": args.repeats, "tasks": rows,
            "load_1min_after": os.getloadavg()[0]}


def _max_ll_diff(first: dict, second: dict, task_name: str) -> float:
    """The largest |difference| between two backends' log-likelihoods of the same requests."""
    return max(abs(a - b) for doc, lls in first["lls"][task_name].items()
               for a, b in zip(lls, second["lls"][task_name][doc]))


def _table_row(cells: list, bold: bool = False) -> str:
    return "| " + " | ".join(f"**{c}**" if bold and c != "" else str(c) for c in cells) + " |"


def _speedups(seconds: dict, faster: str, *slower: str) -> list[str]:
    return [f"{seconds[b] / seconds[faster]:.2f}x" for b in slower]


def _fp32_timings(seconds: dict) -> list[str]:
    """lm-eval hf, the path before and goodput fp32: seconds, then goodput's speed-ups."""
    return ([f"{seconds[b]:.1f}" for b in ("lm-eval hf", "goodput before", "goodput")]
            + _speedups(seconds, "goodput", "lm-eval hf", "goodput before"))


def _bf16_timings(seconds: dict) -> list[str]:
    """goodput fp32 and bf16: seconds, then bf16's speed-ups over fp32, lm-eval hf, before."""
    return ([f"{seconds[b]:.1f}" for b in ("goodput", "goodput bf16")]
            + _speedups(seconds, "goodput bf16", "goodput", "lm-eval hf", "goodput before"))


def backends_table(result: dict) -> str:
    rows = result["tasks"]
    per_task = {task: row for task, row in rows.items() if task != "all"}
    total = {b: sum(row["seconds"][b] for row in per_task.values()) for b in BACKENDS}
    together = rows["all"]["seconds"] if "all" in rows else None
    whole = sum(r["tokens_whole"] for r in per_task.values())
    packed = sum(r["tokens_packed"] for r in per_task.values())
    items, requests = sum(r["items"] for r in per_task.values()), sum(r["requests"] for r in per_task.values())
    sizes = [items, f"{requests:,}", f"{whole:,} / {packed:,}"]
    lines = [f"Model {result['model']} ({result['params'] / 1e6:.1f}M parameters) on "
             f"{result.get('device', 'cpu')}, eval.limit={result['limit']}, "
             f"batch size {result['batch_size']}, torch threads {result['threads']}, median of "
             f"{result['repeats']} run(s) per task and backend, backends in turn; load (1 min) "
             f"{result['load_1min_after']:.2f} at the end",
             "",
             "| task (local, shaped like) | items | requests | tokens read: whole / packed | lm-eval hf, s "
             "| goodput before, s | goodput, s | vs lm-eval hf | vs before | max \\|Δ log-lik\\|: goodput vs before / "
             "goodput vs hf / before vs hf "
             "| scores equal to before |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, row in per_task.items():
        now, before = row["scores"]["goodput"], row["scores"]["goodput before"]
        # accuracies exact; perplexities (sums in float64 now, float32 before) to 1e-6 relative
        close = all(v == before[m] if m.startswith("acc") else abs(v - before[m]) <= 1e-6 * abs(before[m])
                    for m, v in now.items())
        lines.append(_table_row([task, row["items"], f"{row['requests']:,}",
                                 f"{row['tokens_whole']:,} / {row['tokens_packed']:,}",
                                 *_fp32_timings(row["seconds"]),
                                 " / ".join(f"{d:.1e}" for d in row["max_ll_diff"].values()),
                                 "yes" if now == before else "within 1e-6" if close else "no"]))
    lines.append(_table_row([f"all {len(per_task)}, each alone, summed", *sizes, *_fp32_timings(total), "", ""]))
    if together:
        lines.append(_table_row([f"all {len(per_task)} in one evaluation", *sizes, *_fp32_timings(together),
                                 "", ""], bold=True))
    lines.append("")
    lines.append("Scores (goodput): " + "; ".join(
        f"{task} " + ", ".join(f"{m} {v:.4g}" for m, v in row["scores"]["goodput"].items())
        for task, row in per_task.items()))
    lines += ["", "bf16 (`eval.precision=bf16`) against the same packed path in fp32:", "",
              "| task | goodput fp32, s | goodput bf16, s | bf16 vs fp32 | bf16 vs lm-eval hf | bf16 vs before "
              "| max \\|Δ log-lik\\| vs fp32 | accuracies fp32 / bf16 (lm-eval's stderr) | within the stderr |",
              "|---|---|---|---|---|---|---|---|---|"]
    for task, row in per_task.items():
        fp32, bf16 = row["scores"]["goodput"], row["scores"]["goodput bf16"]
        accs = [(m, v, bf16[m], row["stderrs"].get(m, 0.0)) for m, v in fp32.items() if m.startswith("acc")]
        lines.append(_table_row([task, *_bf16_timings(row["seconds"]), f"{row['bf16_max_ll_diff']:.1e}",
                                 "; ".join(f"{m} {a:.3f} / {b:.3f} ({e:.3f})" for m, a, b, e in accs),
                                 "yes" if all(abs(a - b) <= e for _, a, b, e in accs) else "no"]))
    lines.append(_table_row(["all, each alone, summed", *_bf16_timings(total), "", "", ""]))
    if together:
        lines.append(_table_row(["all in one evaluation", *_bf16_timings(together), "", "", ""], bold=True))
    if any("max_ll_error" in row for row in per_task.values()):
        lines += ["", f"Each fp32 path against the {REFERENCE} (the path before with the model, its "
                  "softmax and sums in float64), the largest |Δ log-lik| of a request:", "",
                  _table_row(["task", *REFERENCE_COMPARED]), "|---|---|---|---|"]
        for task, row in per_task.items():
            if "max_ll_error" in row:
                lines.append(_table_row([task, *(f"{row['max_ll_error'][b]:.1e}"
                                                 for b in REFERENCE_COMPARED)]))
    return "\n".join(lines)


# --- part train ----------------------------------------------------------------------------

def eval_intervals(flow_run_id) -> list[tuple[float, float]]:
    """(start, end) of every evaluate-validated task run of the flow run, in epoch seconds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted((run.start_time.timestamp(), run.end_time.timestamp()) for run in runs
                  if run.name.startswith("evaluate-step-") and run.start_time and run.end_time)


def train_once(args, workdir: Path, task_dir: Path, every: int) -> dict:
    from core.config import load_config
    from flows.train import train
    from training.metrics import read_metrics

    run_id = f"evalbench-{'on' if every else 'off'}-{int(time.time())}"
    config = load_config(None, [
        *base_overrides(workdir, args.train_model), f"run.run_id={run_id}",
        "parallelism.nproc_per_node=1", "launch.env={OMP_NUM_THREADS: '1'}",
        f"training.max_steps={args.train_steps}", "training.warmup_steps=5", "training.seq_len=128",
        f"training.micro_batch_size={args.micro_batch}", f"checkpoint.every_steps={args.checkpoint_every}",
        "checkpoint.keep_local=2", f"eval.every_validated={every}", f"eval.task_dir={task_dir}",
        f"eval.tasks=[{', '.join(TASKS[t][0] for t in args.tasks)}]", f"eval.limit={args.train_limit}",
        f"eval.batch_size={args.batch_size}", "eval.max_batches=1", "eval.num_samples=0"])
    load_before = os.getloadavg()[0]
    state = train(config, return_state=True)
    if not state.is_completed():  # (its result is not read back: under load, the ephemeral
        state.result()            # API once handed back a Completed state without its data)
    load_after = os.getloadavg()[0]
    records = sorted((r for r in read_metrics(config.run_dir) if "step_time_s" in r), key=lambda r: r["step"])
    intervals = eval_intervals(state.state_details.flow_run_id) if every else []
    steps = []
    for previous, record in zip(records, records[1:]):
        if record["step"] <= args.warmup_steps:
            continue
        during = any(start < record["time"] and previous["time"] < end for start, end in intervals)
        steps.append({"step": record["step"], "step_time_s": record["step_time_s"],
                      "interval_s": record["time"] - previous["time"], "during_eval": during})
    first, last = records[0]["time"], records[-1]["time"]
    overlapping = [iv for iv in intervals if iv[0] < last and first < iv[1]]
    return {"run_id": run_id, "every_validated": every, "steps": steps,
            "eval_intervals": intervals, "evaluations": len(intervals),
            "evaluations_overlapping": len(overlapping),
            "eval_seconds": [end - start for start, end in intervals],
            "load_1min_before": load_before, "load_1min_after": load_after}


def medians(steps: list[dict]) -> dict:
    if not steps:
        return {"n": 0, "step_time_s": None, "interval_s": None}
    return {"n": len(steps), "step_time_s": statistics.median(s["step_time_s"] for s in steps),
            "interval_s": statistics.median(s["interval_s"] for s in steps)}


def trainer_slowdown(args, workdir: Path, task_dir: Path) -> dict:
    os.environ["OMP_NUM_THREADS"] = str(args.eval_threads)  # the evaluation (and validation) processes
    runs = []
    for _ in range(args.repeats):
        for every in (0, args.every_validated):
            runs.append(train_once(args, workdir, task_dir, every))
            print(f"  train with eval.every_validated={every}: {len(runs[-1]['steps'])} steps "
                  f"measured, {runs[-1]['evaluations']} evaluations", flush=True)
    off = [s for r in runs if not r["every_validated"] for s in r["steps"]]
    on = [s for r in runs if r["every_validated"] for s in r["steps"]]
    summary = {"off": medians(off), "on": medians(on),
               "on_during_eval": medians([s for s in on if s["during_eval"]]),
               "on_outside_eval": medians([s for s in on if not s["during_eval"]])}
    return {"model": args.train_model, "steps": args.train_steps, "warmup_steps": args.warmup_steps,
            "micro_batch": args.micro_batch, "checkpoint_every": args.checkpoint_every,
            "every_validated": args.every_validated, "tasks": args.tasks, "limit": args.train_limit,
            "eval_threads": args.eval_threads, "runs": runs, "summary": summary}


def cell(m: dict) -> str:
    return f"{m['step_time_s']:.4f} ({m['n']})" if m["n"] else "-"


def train_table(result: dict) -> str:
    """Each run (in the order run), then the steps of all runs pooled by kind."""
    s, runs = result["summary"], result["runs"]
    lines = [f"{result['model']} model, {result['steps']} steps of {result['micro_batch']} x 128 tokens "
             f"(steps 1-{result['warmup_steps']} left out), a checkpoint every {result['checkpoint_every']} "
             f"steps; evaluations on: eval.every_validated={result['every_validated']}, "
             f"{len(result['tasks'])} tasks x {result['limit']} items, evaluation threads "
             f"{result['eval_threads']}; {len(runs) // 2} run(s) each way, in turn",
             "",
             "| run | eval.every_validated | load (1 min) before / after | median step_time_s, all steps "
             "| while an evaluation ran (steps) | other steps (steps) | evaluations: overlapping / run, "
             "seconds each |",
             "|---|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, start=1):
        during = medians([x for x in run["steps"] if x["during_eval"]])
        other = medians([x for x in run["steps"] if not x["during_eval"]])
        lines.append(
            f"| {i} | {run['every_validated']} | {run['load_1min_before']:.2f} / {run['load_1min_after']:.2f} "
            f"| {medians(run['steps'])['step_time_s']:.4f} "
            f"| {cell(during)} "
            f"| {cell(other)} "
            f"| {run['evaluations_overlapping']} / {run['evaluations']}"
            f"{': ' + ', '.join(f'{x:.0f}' for x in run['eval_seconds']) if run['eval_seconds'] else ''} |")
    base = s["off"]
    lines += ["", "| steps, all runs pooled | n | median step_time_s | vs off | median interval between "
              "steps, s | vs off |", "|---|---|---|---|---|---|"]
    for label, key in (("evaluations off (baseline)", "off"), ("evaluations on: all steps", "on"),
                       ("evaluations on: steps while one ran", "on_during_eval"),
                       ("evaluations on: other steps", "on_outside_eval")):
        m = s[key]
        if not m["n"]:
            lines.append(f"| {label} | 0 | | | | |")
            continue
        lines.append(f"| {label} | {m['n']} | {m['step_time_s']:.4f} | {m['step_time_s'] / base['step_time_s']:.3f}x"
                     f" | {m['interval_s']:.4f} | {m['interval_s'] / base['interval_s']:.3f}x |")
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["eval", "train", "both", "backends"], default="both",
                        help="backends: goodput's lm-eval model against lm-eval's hf and the one before")
    parser.add_argument("--model", choices=sorted(MODELS), default="100m", help="part eval's model")
    parser.add_argument("--limit", type=int, default=200, help="part eval: eval.limit (items per task)")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--batch-size", type=int, default=8, help="eval.batch_size")
    parser.add_argument("--train-model", choices=sorted(MODELS), default="20m")
    parser.add_argument("--train-steps", type=int, default=80)
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of medians")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--every-validated", type=int, default=2, help="eval.every_validated when on")
    parser.add_argument("--train-limit", type=int, default=20, help="part train: eval.limit")
    parser.add_argument("--eval-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the flow process, so of the evaluation processes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="part train: off/on pairs, in turn; part backends: runs per task and backend")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="part backends: where every backend scores (cuda: one GPU; there "
                             "'goodput bf16' is what eval.precision=auto picks)")
    parser.add_argument("--threads", type=int, default=0,
                        help="part backends: torch threads of every backend (default: torch's)")
    parser.add_argument("--float64-reference", action="store_true",
                        help="part backends: also score each task once in float64 (the path "
                             "before, untimed; about twice its time) and report each path's "
                             "largest log-likelihood difference from it")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown {unknown}; choose from {list(TASKS)}")
    if args.device == "cuda" and args.part != "backends":
        parser.error("--device cuda is for --part backends (part eval runs `goodput evaluate`'s "
                     "path, which takes the GPU where there is one)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="eval-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    dataset_dir = prepared_dataset(workdir)
    task_dir = write_tasks(workdir / "tasks", corpus_file(workdir), max(args.limit, args.train_limit))
    results = {"workdir": str(workdir), "cpus": os.cpu_count(), "tasks": args.tasks}
    if args.part in ("eval", "both"):
        results["eval"] = eval_cost(args, workdir, dataset_dir, task_dir)
    if args.part == "backends":
        results["backends"] = compare_backends(args, workdir, dataset_dir, task_dir)
    if args.part in ("train", "both"):
        print(f"\n## train: load before {os.getloadavg()[0]:.2f}", flush=True)
        results["train"] = trainer_slowdown(args, workdir, task_dir)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    print()
    if "eval" in results:
        print("### A five-task evaluation of a checkpoint\n")
        print(eval_table(results["eval"]))
        print()
    if "backends" in results:
        print("### Goodput's lm-eval model against lm-eval's hf model, per task\n")
        print(backends_table(results["backends"]))
        print()
    if "train" in results:
        print("### The trainer while checkpoints are evaluated beside it\n")
        print(train_table(results["train"]))


if __name__ == "__main__":
    main()
