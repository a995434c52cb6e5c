"""Held-out loss, perplexity, bits per byte, generated samples and downstream benchmarks
(lm-evaluation-harness, eval.tasks) for one checkpoint, in one process.

    python -m training.evaluate --checkpoint DIR --dataset DIR --config run.yaml --out report.json

With `--from-store COPY_ID`, DIR is the run's own checkpoint directory of a step that this
machine has no copy of, and COPY_ID the copy its ledger names uploaded. The model's weights
are read from the store's copy (the files they are in, writer.shard_file_name, fetched into
the run's `.from-store` cache and checked against the manifest, as a resume from the store
does); the optimizer's are not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if __name__ == "__main__" and "--background" in sys.argv:
    # Started beside training in a session of its own (goodput.evaluation), where no Ctrl-C
    # to the terminal's process group reaches it: it ends with the process that started it,
    # set before torch's import (seconds), in which that process may die.
    from core.process_exit import die_with_the_parent_that_started_it

    die_with_the_parent_that_started_it()

import torch
from tokenizers import Tokenizer

from core.errors import ConfigError
from core.cpu_priority import lower_thread_priority
from core.files import write_atomic
from core.protocol import copy_id, take_request
from storage.manifests import EvalReport, EvalSample
from training.checkpoint.errors import CheckpointCorrupt
from training.checkpoint.reader import load_model
from training.data import TokenStream, TrainingData, open_training_data, sequential_batches
from training.downstream import (downstream_scores, load_tasks, lower_is_better_scores, scoring_settings,
                                 use_datasets_cache)
from training.held_out import mix_held_out_loss
from training.logs import get_logger, setup_worker_logging
from training.model import Transformer
from training.tokenizer import read_tokenizer
from training.tracking import open_trackers

if TYPE_CHECKING:
    from core.config import RunConfig

log = get_logger("eval")


def generate_samples(model: Transformer, tokenizer: Tokenizer, eos_id: int, prompts: list[str],
                     count: int, max_new_tokens: int, temperature: float, top_k: int | None,
                     seed: int, device: torch.device, doc_prefix_ids: tuple = ()) -> list[EvalSample]:
    """`doc_prefix_ids`: what starts a document in training (a BOS), before each prompt."""
    generator = torch.Generator(device=device).manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        # A prompt starts as a document did (an empty one: after the last document's end).
        ids = list(doc_prefix_ids) + tokenizer.encode(prompt, add_special_tokens=False).ids or [eos_id]
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature,
                             top_k, generator, n_tokens=tokenizer.get_vocab_size())
        samples.append(EvalSample(prompt=prompt, completion=tokenizer.decode(out[0, len(ids):].tolist())))
    return samples


def held_out_bits_per_byte(data: TrainingData, source_losses: dict[str, float], tokenizer: Tokenizer,
                           seq_len: int, batch_size: int, max_batches: int) -> float | None:
    """Bits per UTF-8 byte of the held-out text: each source's loss (nats per token) times
    the tokens it covers, over ln 2 times their bytes; a mix's weighted by its shares, as its
    loss is. None when the text decodes to no bytes."""
    per_source = {}
    for source in data.sources:
        tokens, n_bytes = _target_bytes(source.stream("validation"), tokenizer, seq_len,
                                        batch_size, max_batches)
        if n_bytes == 0:
            return None
        per_source[source.name] = source_losses[source.name] * tokens / (math.log(2) * n_bytes)
    return data.weighted_by_mix(per_source)


def _target_bytes(stream: TokenStream, tokenizer: Tokenizer, seq_len: int, batch_size: int,
                  max_batches: int) -> tuple[int, int]:
    """The tokens the held-out loss predicts (training.held_out: the same batches) and the
    UTF-8 bytes they decode to. Validation rows are consecutive, so their targets are one
    stretch of text, decoded at once (a character split over two rows stays whole); the
    end-of-document token decodes to nothing."""
    ids = [t.reshape(-1) for _, t in sequential_batches(stream, seq_len, batch_size, max_batches)]
    ids = torch.cat(ids).tolist() if ids else []
    return len(ids), len(tokenizer.decode(ids).encode("utf-8"))


def evaluate_checkpoint(checkpoint: Path, dataset_dir: Path, run_id: str, eval_cfg, seq_len: int,
                        seed: int, device: torch.device | None = None,
                        downstream_tasks: tuple | None = None, reader=None,
                        initial: "RunConfig | None" = None) -> EvalReport:
    """`downstream_tasks`: eval.tasks already loaded (training.downstream.load_tasks);
    `reader`: where the weights are read instead of the directory `checkpoint` (a
    StoreReader of its store copy); `initial`: the run's config, whose model.init_from (the
    directory `checkpoint`) holds the weights the run starts from, evaluated as step 0."""
    start = time.perf_counter()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = open_training_data(dataset_dir)
    if initial is not None:
        model, step = initial_model(initial, data.vocab_size, device), 0
        evaluated_copy = initial.model.init_from_fingerprint
    else:
        # Before loading: the copy the report speaks of.
        evaluated_copy = copy_id(checkpoint) if reader is None else reader.copy_id
        model, ckpt = load_model(checkpoint, device, reader)
        step = ckpt.step
    loss, tokens, source_losses = mix_held_out_loss(model, data, seq_len, eval_cfg.batch_size,
                                                    eval_cfg.max_batches, device)
    tokenizer = read_tokenizer(data.tokenizer_path)  # prompts encode as text, as documents did
    bits_per_byte = held_out_bits_per_byte(data, source_losses, tokenizer, seq_len,
                                           eval_cfg.batch_size, eval_cfg.max_batches)
    samples = generate_samples(model, tokenizer, data.eos_id, eval_cfg.prompts, eval_cfg.num_samples,
                               eval_cfg.sample_tokens, eval_cfg.temperature, eval_cfg.top_k, seed, device,
                               data.doc_prefix_ids)
    downstream, lower_better = {}, []
    settings = {"device": device.type, "max_batches": eval_cfg.max_batches,
                "batch_size": eval_cfg.batch_size, "seq_len": seq_len}
    if eval_cfg.tasks:
        downstream, results = downstream_scores(model, tokenizer, data.eos_id, eval_cfg, device,
                                                loaded=downstream_tasks,
                                                doc_prefix_ids=data.doc_prefix_ids)
        lower_better = lower_is_better_scores(results)
        settings.update(scoring_settings(eval_cfg, device))
    return EvalReport(run_id=run_id, step=step, checkpoint=str(checkpoint),
                      dataset_id=data.dataset_id, loss=loss, perplexity=math.exp(loss),
                      tokens_evaluated=tokens, samples=samples,
                      wall_time_s=time.perf_counter() - start, created_at=time.time(),
                      copy_id=evaluated_copy,
                      source_losses=source_losses if len(data.sources) > 1 else {},
                      bits_per_byte=bits_per_byte, downstream=downstream,
                      downstream_lower_is_better=lower_better, settings=settings)


def initial_model(config: "RunConfig", vocab_size: int, device: torch.device) -> Transformer:
    """The model a run with model.init_from starts from, before its first step: the
    config's shape with the Hugging Face checkpoint's weights (as training loads them)."""
    from training.hf_weights import load_hf_weights
    from training.model import model_args_from_config

    model = Transformer(model_args_from_config(config.model, vocab_size))
    load_hf_weights([model], config.model.init_from, config.model.tie_embeddings)
    return model.to(device).eval()


def eval_curves(report: EvalReport, prefix: str = "eval") -> dict[str, float]:
    """The report's scores as tracking records (eval/...), at its checkpoint's step."""
    return {f"{prefix}/{name}": value for name, value in report.scores().items()}


def curves_prefix(config, report: EvalReport) -> str:
    """Where a report's scores go in the run's trackers: `eval/...` when it was made with
    the run's own eval settings (its config.yaml), else `eval-<settings hash>/...`, so that
    a one-off `goodput evaluate eval.limit=12 eval.num_fewshot=2` does not join the run's
    curve at the same steps with scores of another kind."""
    from core.config import runs_own_eval_settings

    return "eval" if runs_own_eval_settings(config.run_dir, report.eval_hash) else f"eval-{report.eval_hash[:8]}"


def store_copy(config, checkpoint: Path, copy: str):
    """A reader of the store's copy of the run's checkpoint directory `checkpoint` (a step of
    the run, which this machine has no copy of), which must be the copy `copy`."""
    from core.protocol import ResumeSpec, step_of
    from training.checkpoint.reader import open_reader

    if not config.run_dir.holds_checkpoint(checkpoint):
        raise ConfigError(f"--from-store reads a checkpoint of run '{config.run.run_id}' "
                          f"({config.run_dir.checkpoints}/step-N); {checkpoint} is not one")
    reader = open_reader(config.run_dir, config.storage, ResumeSpec.store(step_of(checkpoint)))
    if reader.copy_id != copy:  # another machine replaced it since the ledger was read
        raise RuntimeError(f"the store's copy of {reader.source} is {reader.copy_id}, not the "
                           f"copy {copy} the run's ledger names uploaded: it is being replaced; "
                           "evaluate again once its upload has finished")
    return reader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--background", action="store_true",
                        help="run at the lowest CPU priority (beside training)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the first visible GPU if there is one, else the CPU")
    parser.add_argument("--initial", action="store_true",
                        help="--checkpoint is the config's model.init_from: evaluate the weights "
                             "the run starts from, as step 0")
    parser.add_argument("--from-store", metavar="COPY_ID",
                        help="read the weights of the run's checkpoint --checkpoint from the "
                             "store's copy (this machine has none), which must be the copy "
                             "COPY_ID (the ledger's; core.protocol.copy_id)")
    args = parser.parse_args(argv)
    if args.background:  # before torch starts its intra-op threads, which inherit it
        lower_thread_priority()
    from core.config import load_config

    # The trackers' warnings too (scores a server never got), as this process's own lines,
    # which goodput.evaluation passes on to the flow's log.
    setup_worker_logging(also=("training.tracking",))
    config = load_config(args.config)
    # Before `datasets` is imported (by lm-eval), so it reads only the cache.
    use_datasets_cache(config.eval.offline, config.eval.datasets_cache)
    try:
        # A wrong task name or missing task data fails before the checkpoint is read.
        tasks = load_tasks(config.eval.tasks, config.eval.task_dir) if config.eval.tasks else None
        device = None if args.device == "auto" else torch.device(args.device)
        reader = store_copy(config, Path(args.checkpoint), args.from_store) if args.from_store else None
        report = evaluate_checkpoint(Path(args.checkpoint), Path(args.dataset), config.run.run_id,
                                     config.eval, config.training.seq_len, config.training.seed,
                                     device=device, downstream_tasks=tasks, reader=reader,
                                     initial=config if args.initial else None)
    except ConfigError as e:  # exit 2: a configuration error, never retried (core.protocol)
        log.error("%s", e)
        return 2
    except CheckpointCorrupt as e:  # never scored: the weights are not the validated ones
        log.error("%s: not evaluated (it no longer matches the manifest it was validated "
                  "with); evaluate another step", e)
        return 1
    if reader is not None and reader.fetched:
        log.info("read the weights from %s: fetched %s (%.1f MB) into %s", reader.source,
                 ", ".join(reader.fetched), reader.fetched_bytes / 1e6, reader.local_dir)
    elif reader is not None:
        log.info("read the weights from %s: its files were in %s already", reader.source,
                 reader.local_dir)
    report = report.model_copy(update={"eval_hash": config.eval_hash()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, report.model_dump_json(indent=2).encode())
    # Scores of this run's checkpoints go to its trackers; another run's checkpoint (its
    # report kept under eval/other/) is not this run's curve.
    if config.run_dir.holds_checkpoint(args.checkpoint):
        prefix = curves_prefix(config, report)
        if prefix != "eval":
            log.info("these eval settings are not the run's (its config.yaml): the scores go to "
                     "the trackers as %s/..., not on the run's eval/ curves", prefix)
        trackers = open_trackers(config.tracking, config.run_dir.path, config.run.run_id, job="eval")
        trackers.log(report.step, eval_curves(report, prefix))
        trackers.close()
    log.info("step %d: loss %.4f, perplexity %.2f, %s bits/byte over %s tokens%s", report.step,
             report.loss, report.perplexity,
             "?" if report.bits_per_byte is None else f"{report.bits_per_byte:.4f}",
             f"{report.tokens_evaluated:,}",
             "".join(f", {name} {loss:.4f}" for name, loss in report.source_losses.items()))
    return 0


def main_when_told() -> int:
    """`python -m training.evaluate --when-told`: this module imported first (torch and the
    model's, about 2.5 s of a core), then the evaluation asked for on standard input, one
    JSON line {"cwd": DIR, "argv": [the options of main]} (goodput.evaluation starts it
    before its checkpoint is known). The input closed without one: exits quietly."""
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    argv = take_request(line)
    sys.argv[1:] = argv
    return main(argv)


if __name__ == "__main__":
    # Without Python's own teardown: its last garbage collection over torch's (and lm-eval's)
    # modules took 1.5-2 s of every evaluation process's exit on 2 cores (core.process_exit).
    from core.process_exit import exit_without_teardown

    exit_without_teardown(main_when_told() if sys.argv[1:] == ["--when-told"] else main())
