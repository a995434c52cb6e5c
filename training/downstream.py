"""Downstream benchmarks of a checkpoint through EleutherAI's lm-evaluation-harness.

lm-eval scores the model; this file only gives it the model. `ProjectLM` wraps the
project's own Transformer and dataset tokenizer as an lm-eval model, rather than exporting
to Hugging Face and using lm-eval's `hf` model: no export to write and read back, no second
implementation of the network (the logits are the ones training and the held-out loss
see), and the tokenizer is the `tokenizers` object the documents were encoded with, not
transformers' wrapper of it. Scores are the same quantities either way (sums of
continuation log-probabilities); tests/test_downstream.py checks them against a direct
computation with this model. An item's requests are packed into one sequence, their shared
context read once (pack_requests); lm-eval's `hf` model reuses a context only where the
continuations are one token each.

Task data offline: lm-eval reads each task's dataset through `datasets`. With eval.offline
the evaluation process sets HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, so it reads only the
datasets cache (eval.datasets_cache, filled once on a machine with network by
`python -m training.downstream --fetch hellaswag ...`) or local files a task YAML in
eval.task_dir names (`dataset_path: json` with `dataset_kwargs: {data_files: ...}`).

    python -m training.downstream --fetch TASK [TASK ...] [--task-dir DIR] [--datasets-cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import math
import os
import sys
import time
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from core.errors import ConfigError
from core.files import user_cache_dir, write_atomic
from training.logs import get_logger
from training.model import Transformer

log = get_logger("eval")

# lm-eval is imported inside the functions below: it is heavy (about 2 s), and a run
# without eval.tasks never needs it.


def use_datasets_cache(offline: bool, datasets_cache: str | None) -> None:
    """Point `datasets` at the cache (and keep it off the network) before it is imported."""
    if datasets_cache:
        os.environ["HF_DATASETS_CACHE"] = str(datasets_cache)
    if offline:
        # Without these, a dataset missing from the cache is retried against the hub for
        # minutes on a machine without network before it fails.
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        os.environ["HF_HUB_OFFLINE"] = "1"


class PackedRow(NamedTuple):
    """One sequence the model reads: an item's shared prefix, then each request's own tokens.

    tokens, positions, segments: per token (segment 0: the shared prefix, j: request j's
    own tokens; a request sees the prefix and its own earlier tokens). scored: per request,
    (its index in the requests, the row positions whose logits predict its continuation,
    the continuation's ids)."""
    tokens: list[int]
    positions: list[int]
    segments: list[int]
    scored: list[tuple[int, list[int], list[int]]]


def pack_requests(requests: list[tuple[list[int], list[int]]], groups: list, max_length: int) -> list[PackedRow]:
    """(context ids, continuation ids) per request -> one PackedRow per group of requests.

    Each request reads the last max_length tokens that predict its continuation (the start
    of a long context is cut, as lm-eval's own models cut it). The requests of a group
    (`groups`: a key per request; one multiple-choice item's choices) share the longest
    common prefix of those inputs, computed once; after it come each request's remaining
    tokens, at the positions they hold in the request alone. Any grouping gives the same
    scores; a group whose requests share a context saves recomputing it."""
    members: dict = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    rows = []
    for indices in members.values():
        inputs, continuations = [], []
        for i in indices:
            context, continuation = requests[i]
            whole = (context + continuation)[-(max_length + 1):]
            inputs.append(whole[:-1])
            continuations.append(continuation[-(len(whole) - 1):])  # all of it, unless longer
        prefix = len(inputs[0])
        for other in inputs[1:]:
            prefix = next((k for k, (a, b) in enumerate(zip(inputs[0][:prefix], other)) if a != b),
                          min(prefix, len(other)))
        tokens, positions = inputs[0][:prefix], list(range(prefix))
        segments, scored = [0] * prefix, []
        for j, (i, own, continuation) in enumerate(zip(indices, inputs, continuations), start=1):
            start = len(tokens)  # where this request's own tokens begin in the row
            tokens += own[prefix:]
            positions += range(prefix, len(own))
            segments += [j] * (len(own) - prefix)
            where = [k if k < prefix else start + k - prefix
                     for k in range(len(own) - len(continuation), len(own))]
            scored.append((i, where, continuation))
        rows.append(PackedRow(tokens, positions, segments, scored))
    return rows


def row_batch(rows: list[PackedRow], device: torch.device):
    """Rows padded on the right to the longest: tokens, positions, and the attention mask
    (None where every row is one plain sequence: causal attention then, as in training)."""
    width = max(len(row.tokens) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # padding: -1
    for r, row in enumerate(rows):
        tokens[r, :len(row.tokens)] = torch.tensor(row.tokens)
        positions[r, :len(row.tokens)] = torch.tensor(row.positions)
        segments[r, :len(row.tokens)] = torch.tensor(row.segments)
    if all(max(row.segments, default=0) <= 1 for row in rows):
        return tokens.to(device), None, None
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    query, key = segments[:, :, None], segments[:, None, :]
    mask = causal & ((key == 0) | (key == query))  # padding sees the prefix and itself
    return tokens.to(device), positions.to(device), mask.unsqueeze(1).to(device)


def _make_lm_class():
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class ProjectLM(TemplateLM):
        """lm-eval's view of a project Transformer: log-likelihoods and greedy generation.

        Log-probabilities are over the model's whole (padded) vocabulary, the distribution
        training's cross-entropy and the held-out loss use.

        An item's requests share their context: a multiple-choice item's choices are packed
        into one sequence (pack_requests), the context read once and each choice attending
        to it and to itself only, at the positions it would have alone. Packing rather than
        a K/V cache: one forward pass per batch with the model's own attention call (a
        mask instead of is_causal), no cache state threaded through the layers, and the
        branches of an item of any shape (winogrande's two contexts share the sentence up
        to the blank) share whatever prefix they have. Rows are scored longest first in
        batches of `batch_size` rows, each padded only to the longest row of its batch.
        `precision` (eval.precision): the forward pass under bf16 autocast or in fp32
        (uses_bf16); log-probabilities are taken in float64 either way.
        """

        def __init__(self, model: Transformer, tokenizer: Tokenizer, eos_id: int, batch_size: int,
                     device: torch.device, precision: str = "fp32", doc_prefix_ids: tuple = ()):
            super().__init__()
            self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
            self._device = device
            self.max_length = model.args.max_seq_len
            self._eot = eos_id
            self._prefix = list(doc_prefix_ids)
            self._item_keys: list | None = None
            self.autocast_dtype = torch.bfloat16 if uses_bf16(precision, device) else None

        @property
        def eot_token_id(self) -> int:
            return self._eot

        @property
        def prefix_token_id(self) -> int:
            # Conditions an empty context and the first token of a rolling document as in
            # training: the document's own start (a BOS) where it has one, else the end of
            # the document before it.
            return self._prefix[-1] if self._prefix else self._eot

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            # A text starts as training's documents do (the template's BOS, or nothing);
            # lm-eval asks for none where it puts prefix_token_id before it itself.
            ids = self.tokenizer.encode(string, add_special_tokens=False).ids
            return ids if add_special_tokens is False else self._prefix + ids

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            # lm-eval encodes the requests and hands only their tokens on: the item each
            # belongs to (task, doc_id) is kept here, so an item's requests share a row.
            self._item_keys = [(request.task_name, request.doc_id) for request in requests]
            try:
                return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            finally:
                self._item_keys = None

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, groups: list | None = None,
                                  **kwargs):
            """(context ids, continuation ids) -> (sum of the continuation's log-probs,
            whether greedy decoding gives exactly the continuation). `groups`: a key per
            request, requests of one key packed together (default: the item, else the
            context)."""
            if groups is None:
                keys = self._item_keys if self._item_keys and len(self._item_keys) == len(requests) else None
                groups = keys or [tuple(context) for _, context, _ in requests]
            rows = pack_requests([(context, continuation) for _, context, continuation in requests],
                                 groups, self.max_length)
            rows.sort(key=lambda row: -len(row.tokens))
            results: list[tuple[float, bool] | None] = [None] * len(requests)
            for first in range(0, len(rows), self.batch_size):
                batch = rows[first:first + self.batch_size]
                for i, score in self._score_rows(batch):
                    results[i] = score
                    if requests[i][0] is not None:  # None: a window of a rolling request
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            return results

        @torch.inference_mode()
        def _score_rows(self, rows: list[PackedRow]):
            """(request index, (log-likelihood, greedy)) for every request of the rows."""
            tokens, positions, mask = row_batch(rows, self.device)
            with (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                  else contextlib.nullcontext()):
                logits = self.model(tokens, positions=positions, mask=mask)
            # Only the positions that predict a continuation token go through the softmax, in
            # float64: a sum of dozens of log-probabilities near -9 is a few hundred, where
            # float32 steps by 3e-5, so float32 sums stray by 1e-4 from the exact value.
            which = [(r, k) for r, row in enumerate(rows) for _, where, _ in row.scored for k in where]
            row_index = torch.tensor([r for r, _ in which], device=logits.device)
            position = torch.tensor([k for _, k in which], device=logits.device)
            scored = logits[row_index, position].float()
            targets = torch.tensor([t for row in rows for _, _, continuation in row.scored
                                    for t in continuation], device=logits.device)
            picked = F.log_softmax(scored.double(), dim=-1).gather(1, targets[:, None])[:, 0]
            hits = scored.argmax(dim=-1) == targets
            sizes = [len(continuation) for row in rows for _, _, continuation in row.scored]
            totals = [part.sum().item() for part in picked.split(sizes)]
            greedy = [bool(part.all()) for part in hits.split(sizes)]
            requests = [i for row in rows for i, _, _ in row.scored]
            return zip(requests, zip(totals, greedy))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Each text's whole log-likelihood, in windows of max_length tokens (each token
            predicted once; lm-eval's own windowing). The windows of every text are scored
            together, each a row of its own."""
            windows, owner = [], []
            for n, request in enumerate(requests):
                (text,) = request.args
                for context, target in (make_disjoint_window(w) for w in get_rolling_token_windows(
                        self.tok_encode(text, add_special_tokens=False), self.prefix_token_id,
                        self.max_length, context_len=1)):
                    windows.append((None, context, target))
                    owner.append(n)
            scores = self._loglikelihood_tokens(windows, groups=list(range(len(windows))))
            out = [0.0] * len(requests)
            for n, (score, _) in zip(owner, scores):
                out[n] += score
            for request, total in zip(requests, out):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return out

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """Greedy continuation, cut at the first stop string (gen_kwargs `until`) or after
            `max_gen_toks` tokens (or its aliases max_new_tokens, max_tokens, ..., read as
            lm-eval's backends read them; default 256). Sampling settings are ignored:
            benchmark generation is greedy."""
            from lm_eval.models.utils import normalize_gen_kwargs

            out = []
            n_tokens = self.tokenizer.get_vocab_size()
            for request in requests:
                context, gen_kwargs = request.args
                kwargs = normalize_gen_kwargs(gen_kwargs or {}, default_max_gen_toks=256)
                until, max_new = kwargs["until"], int(kwargs["max_gen_toks"])
                if max_new >= self.max_length:  # as lm-eval's hf model refuses it
                    raise ConfigError(
                        f"a generation task asks for up to {max_new} new tokens (its "
                        "generation_kwargs' max_gen_toks; 256 where unset), not fewer than the "
                        f"model's context of {self.max_length} tokens (model.max_seq_len), "
                        "which leaves no room for the prompt: set a smaller max_gen_toks in the "
                        "task's YAML")
                # The context's last max_length - max_gen_toks tokens, cut once, as lm-eval's
                # hf model does: the generated tokens then never push it out of the window (a
                # window slid per token gave other text than the hf model on long prompts).
                context_ids = (self.tok_encode(context) or [self.eot_token_id])[-(self.max_length - max_new):]
                tokens = torch.tensor([context_ids], device=self.device)
                generated, text = [], ""
                # One token at a time against the kept keys and values (Transformer.stream).
                for next_id in islice(self.model.stream(tokens, temperature=0, n_tokens=n_tokens),
                                      max_new):
                    if next_id.item() == self.eot_token_id:
                        break
                    generated.append(next_id.item())
                    text = self.tok_decode(generated)
                    if any(stop in text for stop in until):
                        break
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return out

    return ProjectLM


def project_lm(model: Transformer, tokenizer: Tokenizer, eos_id: int, batch_size: int,
               device: torch.device, precision: str = "fp32", doc_prefix_ids: tuple = ()):
    """An lm_eval.api.model.LM over the project's model and tokenizer (`eos_id`: the token
    that ended every document in training, `doc_prefix_ids` those that started each, the
    dataset manifest's; `precision`: eval.precision)."""
    return _make_lm_class()(model, tokenizer, eos_id, batch_size, device, precision, doc_prefix_ids)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether eval.precision puts the scoring forward pass under bf16 autocast on `device`:
    'auto' where the device multiplies bf16 matrices natively (native_bf16), 'bf16'
    anywhere, 'fp32' never."""
    if precision == "auto":
        return native_bf16(device)
    return precision == "bf16"


def native_bf16(device: torch.device) -> bool:
    """Whether `device` has bf16 matrix instructions: a CUDA device that supports bf16, or a
    CPU with AVX512-BF16 or AMX (Zen 4 and later, Sapphire Rapids and later). There a bf16
    forward pass of a 100M model took a third of fp32's time on 2 cores (RESULTS,
    "Evaluation at the speed of the model"); a CPU without them would emulate bf16, slower
    than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, check, lambda: False)()
                   for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def check_task_dir(task_dir: str | Path) -> Path:
    """The folder of custom task YAMLs, every YAML in it readable. lm-eval itself skips a
    YAML it cannot read without a word; here that is a ConfigError naming the file."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(task_dir).expanduser()
    if not path.is_dir():
        raise ConfigError(f"eval.task_dir={task_dir} is not a directory; point it at a folder of "
                          "lm-eval task YAMLs, or leave it unset for lm-eval's own tasks")
    for yaml_path in sorted(path.rglob("*.yaml")):
        try:
            cfg = load_yaml(yaml_path, resolve_func=False, recursive=True)
        except Exception as e:  # yaml errors, missing includes, non-mapping files
            raise ConfigError(f"eval.task_dir: {yaml_path} is not a readable lm-eval task YAML "
                              f"({type(e).__name__}: {e}); fix or remove the file") from e
        if not any(key in cfg for key in ("task", "group", "class")):
            log.warning("%s names no task or group; lm-eval skips it (fine if another YAML "
                        "includes it)", yaml_path)
    return path


def task_manager_for(tasks: list[str], task_dir: str | None):
    """lm-eval's TaskManager that knows every name in `tasks` (ConfigError otherwise).

    Indexing lm-eval's own task library takes several seconds (thousands of YAMLs): when
    eval.task_dir defines every requested task, that folder alone is indexed."""
    from lm_eval.tasks import TaskManager

    if task_dir is not None:
        include = str(check_task_dir(task_dir))
        manager = TaskManager(include_path=include, include_defaults=False)
        if all(name in manager.all_tasks for name in tasks):
            return manager
    manager = TaskManager(include_path=str(Path(task_dir).expanduser()) if task_dir else None)
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        raise unknown_tasks_error(unknown, manager.all_tasks, task_dir)
    return manager


def unknown_tasks_error(unknown: list[str], known, task_dir: str | None) -> ConfigError:
    """The ConfigError for task names no index knows: each name with its closest known names,
    and how to list the known ones."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3)
        hints.append(f"'{name}'" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    where = f"lm-eval {_lm_eval_version()}" + (f" or of eval.task_dir={task_dir}" if task_dir else "")
    listing = "`lm-eval ls tasks`" if task_dir is None else f"`lm-eval ls tasks --include_path {task_dir}`"
    return ConfigError(f"eval.tasks: {', '.join(hints)} {'is' if len(unknown) == 1 else 'are'} not a "
                       f"task, group or tag of {where}; use names {listing} lists, or add a task "
                       "YAML to eval.task_dir")


def check_task_names(tasks: list[str], task_dir: str | None) -> dict[str, str]:
    """Where each name of eval.tasks is defined ('eval.task_dir' or 'lm-eval'); ConfigError
    for a name neither defines, or an unreadable eval.task_dir. Reads no task data.

    The check the flows make before anything launches. It answers what task_manager_for
    does, cheaply: eval.task_dir is indexed (a few YAMLs), and lm-eval's own library only
    when a name is not there, from library_task_names (cached per installed lm-eval)."""
    custom: set[str] = set()
    if task_dir is not None:
        from lm_eval.tasks import TaskManager

        include = str(check_task_dir(task_dir))
        manager = TaskManager(include_path=include, include_defaults=False)
        custom = set(manager.all_tasks)
        missing = [f"task {name!r} ({_yaml_of(manager, name)}) reads {path} (its dataset_kwargs."
                   "data_files), which is not here"
                   for name in tasks if name in custom for path in _missing_data_files(manager, name)]
        if missing:
            raise ConfigError("eval.tasks: " + "; ".join(missing) + ". Fix the path in the task's "
                              "YAML; lm-eval reads a relative one from the evaluation process's "
                              f"working directory ({os.getcwd()}): write it absolute")
    library: frozenset[str] = frozenset()
    if any(name not in custom for name in tasks):
        library, indexed = _library_task_names()
        if not indexed and any(name not in custom | library for name in tasks):
            library, _ = _library_task_names(refresh=True)  # refuse on a fresh index only
    unknown = [name for name in tasks if name not in custom and name not in library]
    if unknown:
        raise unknown_tasks_error(unknown, sorted(custom | library), task_dir)
    return {name: "eval.task_dir" if name in custom else "lm-eval" for name in tasks}


def _missing_data_files(manager, name: str) -> list[str]:
    """The local files a task of eval.task_dir names in dataset_kwargs.data_files (a path, a
    glob, a list of them, or a split -> those) that match nothing here; a URL is not checked.
    A missing one failed every evaluation of the run, each after training and loading the
    checkpoint; now the flows' start says so."""
    import glob

    entry = manager.task_index.get(name)
    files = ((getattr(entry, "cfg", None) or {}).get("dataset_kwargs") or {}).get("data_files")
    given = files.values() if isinstance(files, dict) else [files]
    paths = [p for value in given for p in (value if isinstance(value, list) else [value])
             if isinstance(p, str) and "://" not in p]
    return [p for p in paths if not glob.glob(os.path.expanduser(p))]


def _yaml_of(manager, name: str) -> str:
    return str(getattr(manager.task_index.get(name), "yaml_path", "eval.task_dir"))


_LIBRARY_NAMES: dict[tuple, frozenset[str]] = {}  # per process: signature -> names indexed here


def library_task_names(refresh: bool = False) -> frozenset[str]:
    """Every task, group and tag name of the installed lm-eval's own task library.

    Building lm-eval's index reads about 14,000 YAMLs (about 7 s); the names are kept per
    process and on disk ($XDG_CACHE_HOME/goodput, else ~/.cache/goodput), keyed by lm-eval's
    version and its task folder's YAML files (count, newest mtime, total size: a 0.1 s walk),
    so an upgrade or an edited task is indexed again. `refresh`: index now, whatever is kept.
    """
    return _library_task_names(refresh)[0]


def _library_task_names(refresh: bool = False) -> tuple[frozenset[str], bool]:
    """library_task_names, and whether this process indexed them (rather than read them)."""
    from importlib.util import find_spec

    root = Path(find_spec("lm_eval").origin).parent / "tasks"
    count = newest = size = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".ipynb_checkpoints")]
        for file in files:
            if file.endswith(".yaml"):
                stat = os.stat(os.path.join(folder, file))
                count, newest, size = count + 1, max(newest, stat.st_mtime_ns), size + stat.st_size
    signature = (_lm_eval_version(), str(root), count, newest, size)
    cache = user_cache_dir() / f"lm-eval-{signature[0]}-task-names.json"
    if not refresh:
        if signature in _LIBRARY_NAMES:
            return _LIBRARY_NAMES[signature], True
        try:
            kept = json.loads(cache.read_text())
            if tuple(kept["signature"]) == signature:
                return frozenset(kept["names"]), False
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none kept, or unreadable: index
    from lm_eval.tasks import TaskManager

    names = frozenset(TaskManager(include_defaults=True).all_tasks)
    _LIBRARY_NAMES[signature] = names
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps({"signature": signature, "names": sorted(names)}).encode())
    except OSError as e:  # a read-only home: every process indexes for itself
        log.warning("lm-eval's task names not kept in %s (%s)", cache, e)
    return names, True


def load_tasks(tasks: list[str], task_dir: str | None) -> tuple[object, list]:
    """The TaskManager and the built tasks. Building a task reads its data: a dataset that is
    neither cached nor local fails here, as a ConfigError saying how to provide it."""
    manager = task_manager_for(tasks, task_dir)
    built = []
    for name in tasks:
        try:
            loaded = manager.load([name])
        except Exception as e:
            raise ConfigError(
                f"eval.tasks: task '{name}' could not be loaded ({type(e).__name__}: {e}). If its "
                "data is missing: fetch it once on a machine with network (python -m "
                "training.downstream --fetch TASK, with the same eval.datasets_cache), or point "
                "the task's dataset_path at local files in a YAML under eval.task_dir") from e
        built += list(loaded["tasks"].values()) + list(loaded["groups"].values())
    return manager, built


def downstream_scores(model: Transformer, tokenizer: Tokenizer, eos_id: int, eval_cfg, device: torch.device,
                      loaded: tuple | None = None, log_samples: bool = False,
                      doc_prefix_ids: tuple = ()) -> tuple[dict[str, dict[str, float]], dict]:
    """Run lm-eval's tasks (eval.tasks; `loaded`: load_tasks' result, if already loaded) on the
    model: task -> metric -> value, and lm-eval's whole results dict (per-item samples with
    log_samples). lm-eval's own default seeds pick the few-shot examples, so scores compare
    with `lm_eval` runs of other models."""
    from lm_eval import evaluator

    start = time.perf_counter()
    manager, tasks = loaded or load_tasks(list(eval_cfg.tasks), eval_cfg.task_dir)
    results = evaluator.simple_evaluate(
        model=project_lm(model, tokenizer, eos_id, eval_cfg.batch_size, device, eval_cfg.precision,
                         doc_prefix_ids),
        tasks=tasks,
        task_manager=manager, limit=eval_cfg.limit, num_fewshot=eval_cfg.num_fewshot,
        bootstrap_iters=eval_cfg.bootstrap_iters, log_samples=log_samples)
    scores = {task: _metrics(values) for task, values in results["results"].items()}
    settings = scoring_settings(eval_cfg, device)
    log.info("downstream (%s items per task, %s-shot, %s forward pass on %s) in %.1f s: %s",
             eval_cfg.limit or "all", "default" if eval_cfg.num_fewshot is None else eval_cfg.num_fewshot,
             settings["precision"], device.type, time.perf_counter() - start,
             "; ".join(f"{t} " + ", ".join(f"{m} {v:.4f}" for m, v in s.items() if "stderr" not in m)
                       for t, s in scores.items()))
    return scores, results


def scoring_settings(eval_cfg, device: torch.device) -> dict:
    """How eval.tasks are scored on `device`, as an EvalReport records it: the precision
    that runs (eval.precision 'auto' resolved) beside the settings that choose the items."""
    return {"tasks": list(eval_cfg.tasks), "limit": eval_cfg.limit,
            "num_fewshot": eval_cfg.num_fewshot,
            "precision": "bf16" if uses_bf16(eval_cfg.precision, device) else "fp32",
            "lm_eval": _lm_eval_version()}


def _metrics(values: dict) -> dict[str, float]:
    """lm-eval's 'acc,none' -> 'acc' (the metric without a filter); a filtered one keeps its
    filter name ('exact_match,strict-match' -> 'exact_match (strict-match)'). Non-numbers
    (aliases, 'N/A' stderrs) are left out."""
    out = {}
    for key, value in values.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, filter_name = key.split(",", 1)
        if math.isfinite(value):
            out[metric if filter_name == "none" else f"{metric} ({filter_name})"] = float(value)
    return out


def lower_is_better_scores(results: dict) -> list[str]:
    """The '<task>/<metric>' scores that lm-eval says are better lower (its results'
    higher_is_better, e.g. brier_score, word_perplexity), named as _metrics names them."""
    found = []
    for task, metrics in (results.get("higher_is_better") or {}).items():
        for metric, higher in metrics.items():
            if higher is False:
                found.append(f"{task}/{metric}")
    return sorted(found)


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.downstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fetch", nargs="+", required=True, metavar="TASK",
                        help="download these tasks' data into the datasets cache (needs network)")
    parser.add_argument("--task-dir", default=None, help="eval.task_dir, for custom tasks")
    parser.add_argument("--datasets-cache", default=None, help="eval.datasets_cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    use_datasets_cache(offline=False, datasets_cache=args.datasets_cache)
    try:
        _, tasks = load_tasks(args.fetch, args.task_dir)
    except ConfigError as e:
        cause = e.__cause__ or e  # not load_tasks' advice to run this very command
        print(f"error: the data of {', '.join(args.fetch)} could not be fetched "
              f"({type(cause).__name__}: {cause}); this needs access to the Hugging Face Hub "
              "(or HF_ENDPOINT's mirror): run it where there is network, with the same "
              "--datasets-cache as eval.datasets_cache, and copy that cache here", file=sys.stderr)
        return 2
    log.info("fetched the data of %s into %s", ", ".join(args.fetch),
             os.environ.get("HF_DATASETS_CACHE", "the default datasets cache (~/.cache/huggingface)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
