"""`goodput`: run the stages locally (no Prefect server needed), or serve them as deployments.

    goodput pipeline                          # the whole thing on the built-in tiny default
    goodput prepare|train|evaluate|pipeline --config configs/tiny.yaml training.max_steps=50
    goodput evaluate --checkpoint 100         # a given step (or a checkpoint directory)
    goodput serve                             # deployments for the Prefect UI and schedules
    goodput server                            # the production stack: PostgreSQL, Prefect
                                              # server (auth on), work pool, worker, deployments
    goodput export CHECKPOINT_DIR --format hf --out DIR   # a transformers model
    goodput plan --config FILE --nodes 4 --gpus-per-node 8 --gpu-memory 80GiB   # layouts
    goodput plan --config FILE                # the cluster the config names (parallelism.*)
    goodput plan --config FILE --from-run .goodput/runs/ID   # step time from a run's measured MFU
    goodput plan --config FILE --explain      # and the arithmetic behind each figure

Ctrl-C stops training (the workers save an emergency checkpoint first) and the command;
`kill -USR1 PID` prints where each of the command's threads is, should it seem stuck.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from core.config import ConfigError, RunConfig, config_fields, load_config
from core.errors import DataError
from core.process_exit import exit_without_teardown
from flows.local_api import (flow_runs_recorded_by, let_the_api_record, send_prefect_queues,
                             server_configured, temporary_server)
from infra.prefect_stack import LEASES_ON_DISK
from infra.temporary_server import TemporaryServer


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="RunConfig YAML (default: the built-in tiny config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="field overrides, e.g. training.max_steps=50 storage.uri=s3://bucket/p")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's parser, for parse_args' errors
    for name, help_text in [("prepare", "tokenize and shard the dataset, publish it to the store"),
                            ("train", "train with torchrun, validating and uploading checkpoints"),
                            ("evaluate", "held-out loss, perplexity and samples of a checkpoint"),
                            ("pipeline", "prepare, train and evaluate")]:
        p = sub.add_parser(name, help=help_text)
        _config_args(p)
        if name == "evaluate":
            p.add_argument("--checkpoint", help="step number, checkpoint directory or its file:// URL "
                                                "(default: the newest validated); `init`: the "
                                                "model.init_from weights the run starts from")
    p = sub.add_parser("serve", help="serve the flows as deployments (Prefect UI, schedules)")
    _config_args(p)
    p.add_argument("--eval-cron", help="cron schedule for evaluating the newest checkpoint")
    p.add_argument("--train-cron", help="cron schedule continuing the run until training.max_steps "
                                        "(deployment goodput-train-continue)")
    p.add_argument("--train-time-limit", type=float, metavar="SECONDS",
                   help="wall-clock budget of each scheduled training run; past it the workers "
                        "save a checkpoint at their next step and stop, and the next run continues")
    p = sub.add_parser("server", help="the production Prefect stack on this machine: PostgreSQL, "
                                      "a Prefect server on it (API auth on), the work pool "
                                      "'goodput', a worker and prefect.yaml's deployments")
    p.add_argument("--dir", default=".goodput/server",
                   help="where the database, the Prefect home, the logs and the generated "
                        "secrets live (default: .goodput/server)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the server listens on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--pg-port", type=int, default=None,
                   help="PostgreSQL's port on 127.0.0.1 (default: a free one at each start)")
    p.add_argument("--no-worker", action="store_true",
                   help="no worker here (workers run on other machines)")
    p = sub.add_parser("show-config", help="print the resolved configuration")
    _config_args(p)
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face transformers model "
                                      "(Llama; an MoE model as Qwen3-MoE or Mixtral)")
    p.add_argument("checkpoint", help="a committed checkpoint directory (step-XXXXXXXX), or its "
                                      "URL in the store (s3://.../checkpoints/step-XXXXXXXX)")
    p.add_argument("--format", choices=["hf"], default="hf",
                   help="hf: safetensors + config.json that transformers' AutoModelForCausalLM "
                        "loads (LlamaForCausalLM; Qwen3MoeForCausalLM or MixtralForCausalLM)")
    p.add_argument("--out", required=True, help="output directory (must be empty or new)")
    p.add_argument("--tokenizer", help="tokenizer.json, or the directory of the dataset (or mixture) "
                                       "the run trained on, or that dataset's URL in the store "
                                       "(s3://BUCKET/PREFIX/datasets/ID), to include")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default: as saved)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--ignore-tokenizer-mismatch", action="store_true",
                   help="include --tokenizer although it is not the file the checkpoint's data "
                        "was tokenized with (the same tokenizer saved again)")
    p = sub.add_parser("plan", help="validate the config's parallelism layout on a cluster, or "
                                    "rank every layout when it leaves the degrees at defaults")
    _config_args(p)
    p.add_argument("--nodes", type=_positive(int, ranged="parallelism.nnodes"), help="default: the config's parallelism.nnodes")
    p.add_argument("--gpus-per-node", type=_positive(int),
                   help="default: the config's parallelism.nproc_per_node (one worker per GPU)")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GiB or 141GB; default: the "
                                        "config's parallelism.device_memory")
    p.add_argument("--gpu-tflops", type=_positive(float),
                   help="peak dense bf16 TFLOP/s per GPU, for the step-time estimate; default: "
                        "the config's training.peak_flops_per_device, else an H100's 989 (on "
                        "parallelism.device=cpu: no estimate)")
    p.add_argument("--intra-node-gbps", type=_positive(float), default=450.0,
                   help="GB/s per GPU within a node (NVLink, one direction)")
    p.add_argument("--inter-node-gbps", type=_positive(float), default=50.0,
                   help="GB/s per GPU between nodes (400 Gb/s InfiniBand)")
    p.add_argument("--compute-efficiency", type=float, metavar="SHARE",
                   help="share of peak FLOP/s the GPUs' matmuls sustain, for the step-time "
                        "estimate; attention and memory-bound work scale with it (default: "
                        "goodput/planner.py's MATMUL_EFFICIENCY, set on published runs)")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="take the compute efficiency from a finished GPU run: the MFU its "
                        "metrics.jsonl logged, on its own config and layout")
    p.add_argument("--strict", action="store_true",
                   help="refuse layouts the planner only warns about (e.g. fewer than 2 x pp "
                        "pipeline micro-batches); also parallelism.strict_layout=true")
    p.add_argument("--search", action="store_true", help="rank all layouts even when the "
                                                         "config sets one")
    p.add_argument("--top", type=_positive(int), default=10, help="layouts shown in the ranking")
    p.add_argument("--explain", action="store_true",
                   help="the arithmetic behind each figure of the best (or given) layout: FLOPs "
                        "per token, bytes per GPU of each kind, each collective's volume and "
                        "time, the bubble, as a table to check by hand")
    return parser


def _positive(kind: type, ranged: str | None = None) -> Callable[[str], float]:
    """An argparse type: a number above 0 (a speed or a count of 0 has no plan). `ranged`:
    the config field that takes a MIN:MAX range where the flag takes a number."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            hint = f" (a range is the config's: {ranged}={text})" if ranged and ":" in text else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{hint}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return value

    return parse


def _prepared(config, dataset) -> dict:
    """What `goodput prepare` prints: the dataset (or mixture) and, where it lies here, the
    directory to give `torchrun -m training --dataset` or `goodput export --tokenizer`."""
    from goodput.data.prepare import local_dataset_dir

    result = dataset.model_dump(include={"dataset_id", "vocab_size"})
    directory = local_dataset_dir(config, dataset)
    if directory is not None:
        result["dataset_dir"] = str(directory)
    return result


def _export(args: argparse.Namespace) -> int:
    from training.export import ExportError, export_hf

    try:
        summary = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer, dtype=args.dtype,
                            force=args.force,
                            ignore_tokenizer_mismatch=args.ignore_tokenizer_mismatch)
    except ExportError as e:
        print(f"goodput: export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


# Degrees that fill any cluster: what `goodput plan --search` plans a config with whose own
# degrees do not fit the cluster the flags describe (it ranks every layout anyway).
SEARCH_ANY_DEGREES = ("parallelism.dp_replicate=1", "parallelism.dp_shard=-1", "parallelism.tp=1",
                      "parallelism.pp=1")


def _plan(args: argparse.Namespace) -> int:
    """Exit 0 with a table (and the best or given layout explained), 2 when it cannot run.

    The cluster is what the flags say, else what the config says (parallelism.nnodes,
    nproc_per_node, device_memory): a config written for its cluster plans with no flags.
    """
    from goodput import planner

    try:
        # The cluster defines the world size the config's degrees must fill: flags given
        # become overrides, applied after the user's.
        cluster_overrides = [f"parallelism.{field}={value}" for field, value in
                             (("nnodes", args.nodes), ("nproc_per_node", args.gpus_per_node))
                             if value is not None]
        if args.gpus_per_node is not None:  # a node's GPUs are its workers' (one each)
            cluster_overrides += [f"launch.{kind}.gpus_per_node={args.gpus_per_node}"
                                  for kind in ("slurm", "kubernetes")]
        try:
            config = load_config(args.config, [*args.overrides, *cluster_overrides])
        except ConfigError as own:
            if not args.search:
                raise
            # The config's degrees made for another cluster: --search ranks every layout of
            # this one, whatever they are.
            try:
                config = load_config(args.config, [*args.overrides, *SEARCH_ANY_DEGREES,
                                                   *cluster_overrides])
            except ConfigError:
                raise own from None
        config = planner.with_run_vocab(config)
        if args.gpu_memory is not None and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", args.gpu_memory):
            number = args.gpu_memory.strip()
            raise ConfigError(f"--gpu-memory {number}: give the memory of one GPU with its unit, "
                              f"e.g. {number if float(number) > 0 else 80}GiB (or GB, MiB)")
        memory = args.gpu_memory or config.parallelism.device_memory
        par = config.parallelism
        # GPUs unless the config says CPU: a laptop plans the GPU cluster it will launch on.
        device = "cpu" if par.device == "cpu" else "cuda"
        host = False  # CPU workers on this machine's memory: their processes count too
        if memory is None and par.device == "cpu":  # workers on this machine
            memory = str(planner.local_device_memory("cpu", par.nproc_per_node)[0])
            host = config.launch.kind == "local"
        elif memory is None and par.device == "auto":
            # As the train flow's check-layout plans it: on the device training resolves
            # 'auto' to (a local launch: this machine's, CPU on a CPU build of torch), with
            # that device's memory here.
            here, _ = planner.run_cluster(config)
            if here.gpu_memory is not None:
                device, memory, host = here.device, str(here.gpu_memory), here.host_processes
        if memory is None:
            raise ConfigError("memory per GPU unknown: pass --gpu-memory (e.g. 80GiB) or set "
                              "parallelism.device_memory in the config (or parallelism.device=cpu "
                              "to plan CPU workers on this machine's memory)")
        if planner.parse_bytes(memory) <= 0:
            raise ConfigError(f"--gpu-memory {memory}: give the memory of one GPU, e.g. 80GiB")
        flops = (args.gpu_tflops * 1e12 if args.gpu_tflops is not None
                 else config.training.peak_flops_per_device
                 or (planner.H100_FLOPS if device == "cuda" else None))
        cluster = planner.Cluster(par.nnodes, par.nproc_per_node, planner.parse_bytes(memory),
                                  gpu_flops=flops, device=device, host_processes=host,
                                  intra_node_bandwidth=args.intra_node_gbps * 1e9,
                                  inter_node_bandwidth=args.inter_node_gbps * 1e9)
        if args.compute_efficiency is not None:
            if not 0 < args.compute_efficiency <= 1:
                raise ConfigError(f"--compute-efficiency {args.compute_efficiency}: give a share "
                                  "of peak FLOP/s in (0, 1], e.g. 0.4")
            cluster = replace(cluster, compute_efficiency=args.compute_efficiency,
                              efficiency_source="--compute-efficiency")
        elif args.from_run:
            cluster = planner.efficiency_from_run(args.from_run, cluster)
    except ConfigError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    strict = args.strict or config.parallelism.strict_layout
    plans = planner.plan(config, cluster, force_search=args.search, strict=strict)
    print(planner.format_table(plans, limit=args.top))
    print()
    print(planner.explain(plans[0], cluster))
    if args.explain:
        print()
        print(planner.explain_table(plans[0], cluster, config))
    if not plans[0].ok:
        print("goodput: " + ("no layout fits" if len(plans) > 1 else f"layout {plans[0].name} "
              "cannot run") + ":\n" + "\n".join(f"  - {p}" for p in plans[0].problems),
              file=sys.stderr)
        return 2
    return 0


def _server(args: argparse.Namespace) -> int:
    """Start the stack, say how to reach it, keep it up (PostgreSQL, the server or the worker,
    when one dies, is started again) until Ctrl-C or SIGTERM, then stop it, cancelling its
    worker's flow runs first; its data stays in --dir."""
    from infra.prefect_stack import PrefectStack, missing_postgres

    missing = missing_postgres()
    if missing:
        print(f"goodput: server: PostgreSQL not found ({', '.join(missing)}): install it "
              "(Debian: apt-get install postgresql)", file=sys.stderr)
        return 2
    stack = PrefectStack(args.dir, host=args.host, port=args.port, worker=not args.no_worker,
                         pg_port=args.pg_port)
    # Stop as on Ctrl-C: on SIGTERM, and on SIGINT also where the shell started this in the
    # background (`goodput server &`), which ignores SIGINT: `kill -INT` left it running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.start()
        auth_file = stack.directory / "api-auth-string"
        print(f"Prefect server on PostgreSQL: {stack.url} (the UI asks for the auth string)\n"
              f"Clients (goodput commands, prefect CLI, flow runs on other workers):\n"
              f"  export PREFECT_API_URL={stack.api_url}\n"
              f"  export PREFECT_API_AUTH_STRING=\"$(cat {auth_file})\"\n"
              f"Work pool '{stack.pool}'" + (" with a worker" if stack.with_worker else "")
              + "; deployments from prefect.yaml. Ctrl-C stops it all (flow runs under way "
              "are cancelled first: training saves an emergency checkpoint); the data stays "
              f"in {stack.directory}.", flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"goodput: server: listening on {args.host}: anyone who can reach it and has "
                  "the auth string can start training; serve it over TLS (a reverse proxy)",
                  file=sys.stderr)
        while True:
            time.sleep(5)
            try:
                for what, log in stack.keep_up():
                    print(f"goodput: server: {what} had exited; started again (log: {log})",
                          file=sys.stderr)
            except (RuntimeError, TimeoutError, OSError) as e:  # tried again in 5 s
                print(f"goodput: server: {e}; trying again", file=sys.stderr)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"goodput: server: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop(say=lambda message: print(f"goodput: server: {message}", file=sys.stderr,
                                             flush=True))


def _without_a_flow(command: str, config: RunConfig, checkpoint: str | None = None) -> dict | None:
    """A command with nothing to do, decided here before Prefect (its import, its temporary
    server, a flow run) costs seconds, by the library checks its flow makes:

    - prepare: every source's dataset found prepared and published (goodput.data.prepare's
      nothing_to_prepare: find_prepared, and what publish would send);
    - train: that, and the run trained to max_steps with every checkpoint on this machine
      judged and uploaded (checkpoint_lifecycle.run_finished, unjudged_steps, unsecured_steps),
      by this very config (goodput.runs.write_run_config refuses one the run's checkpoints do
      not continue, as the flow does);
    - evaluate: that, and a report kept with the run for the checkpoint the stage picks, made
      of the copy it reads (this machine's, or the store's the ledger names uploaded) with these
      settings on this dataset (evaluation.report_to_reuse);
    - pipeline: all three.

    Says what it found where, records each stage in summary.json as its flow does, and
    returns the command's result; None to run the flow, which then decides as always: when
    there is work, when a check fails (the flow retries and reports the error), when keys
    come from Prefect blocks, or when a Prefect server is configured (the run is shown there).
    """
    if config.storage.credentials_block or config.tracking.wandb_api_key_block:
        return None
    from goodput import evaluation
    from goodput.data import prepare as lib
    from goodput.runs import record_training

    started = time.time()
    stages = {"pipeline": ("prepare", "train", "evaluate")}.get(command, (command,))
    decided: list = []
    # The checks may read the store: one slow or unreachable there (each request retried, then
    # the whole operation) held the command for minutes before its flow, which retries the
    # same and reports it, even started. They get PRECHECK_S; past it, the flow decides.
    check = threading.Thread(target=lambda: decided.append(_nothing_to_do(stages, config, checkpoint)),
                             name="nothing-to-do", daemon=True)
    with _the_checks_warnings():
        check.start()
        check.join(PRECHECK_S)
    if check.is_alive():
        _say(f"the check for work to do took over {PRECHECK_S:g} s (is the store slow or "
             "unreachable?): the flow decides")
        return None
    if not decided or decided[0] is None:
        return None
    found, mix, dataset, report = decided[0]
    result = {}
    if "prepare" in stages:
        for source, manifest, where, listed in found:
            how = ("from the same listing and settings" if listed else
                   "its sources are not here: found by the data settings it was prepared with")
            _say(f"dataset {manifest.dataset_id}" + (f" (source {source.name})" if config.data.sources else "")
                + f" is already prepared in {where} ({how}) and published: nothing to tokenize "
                "or upload")
        lib.record_prepare(config, [(source.name, manifest, None, None) for source, manifest, *_ in found],
                           started, mix if config.data.sources else None)
        result = _prepared(config, dataset)
    if "train" in stages:
        trained = record_training(config, {"attempt": None, "step": None, "wall_time_s": 0.0,
                                           "already_complete": True}, started)
        _say(f"run '{config.run.run_id}' is already trained to step {trained['final_step']} "
            f"(training.max_steps={config.training.max_steps}), every checkpoint validated and "
            "uploaded: nothing to train")
        result = trained
    if "evaluate" in stages:
        evaluation.record_eval(config, report, started)
        _say(f"checkpoint step {report.step} is already evaluated with these eval settings on "
            f"dataset {report.dataset_id}: {evaluation.report_path(config, Path(report.checkpoint))}")
        result = report.model_dump(exclude={"samples"})
    if command == "pipeline":
        result = {"dataset_id": dataset.dataset_id, "final_step": trained["final_step"],
                  "eval_loss": report.loss, "perplexity": report.perplexity,
                  "run_dir": str(config.run_dir)}
    _say(f"{command}: nothing to do; no flow run started")
    return result


PRECHECK_S = 15.0  # what a command's check for work to do may take before its flow decides
STORE_REACH_S = 20.0  # how long a command waits for a store it cannot connect to (a restart)


def _store_out_of_reach(config: RunConfig) -> str | None:
    """Why the command cannot reach the run's store at all (Store.out_of_reach), else None.

    Every stage reads or writes the store. A wrong storage.endpoint_url, or a store not
    started, took about 3 minutes to fail: each request retried, each operation, then the
    task. Said before any flow run, it takes STORE_REACH_S. The endpoint of a credentials
    block is read in the flow (None here); a flow run's tasks still retry a store that goes
    away later.
    """
    if config.storage.credentials_block:
        return None
    from storage.store import store_from_config

    try:
        store = store_from_config(config.storage)
    except Exception:  # noqa: BLE001 - a store that cannot even be opened: the flow says why
        return None
    return store.out_of_reach(STORE_REACH_S)


def _nothing_to_do(stages: tuple[str, ...], config: RunConfig, checkpoint: str | None) -> tuple | None:
    """_without_a_flow's checks: (found, mix, dataset, report) when `stages` have nothing to
    do; None when one has work, or a check fails (the flow then retries what is transient and
    reports the rest)."""
    from goodput import checkpoint_lifecycle as lifecycle
    from goodput import evaluation
    from goodput.data import prepare as lib
    from goodput.runs import write_run_config
    from storage.store import store_from_config

    try:
        store = store_from_config(config.storage)
        found = lib.nothing_to_prepare(config, store)
        if found is None:
            return None
        mix = lib.mixture_manifest([(source, manifest) for source, manifest, *_ in found])
        dataset = mix if config.data.sources else found[0][1]
        if "train" in stages:
            if not (lifecycle.run_finished(config, store) and not lifecycle.unjudged_steps(config)
                    and not lifecycle.unsecured_steps(config)):
                return None
            write_run_config(config)  # a config the run's checkpoints do not continue: ConfigError
        report = None
        if "evaluate" in stages:
            report = evaluation.report_to_reuse(config, store, dataset.dataset_id, checkpoint)
            if report is None:
                return None
        if server_configured():
            return None
    except Exception:
        return None
    return found, mix, dataset, report


def _say(message: str) -> None:
    print(f"goodput: {message}", file=sys.stderr)


class _TheChecksWarnings(logging.Handler):
    """The library's warnings while the command checks for work, before Prefect's console
    exists: on stderr as `goodput: warning: ...`, and remembered (`said`). Where the flow then
    runs, its tasks make the same checks and warn again: the console does not show those
    repeats (_EachErrorOnceOnTheConsole); the flow run's log has them. A folder with a
    test.jsonl in it was said twice, once as a bare line."""

    LOGGERS = ("goodput", "storage")  # the library loggers the checks log to
    said: set[str] = set()

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.said.add(message)
        print(f"goodput: {record.levelname.lower()}: {message}", file=sys.stderr)


@contextmanager
def _the_checks_warnings() -> Iterator[None]:
    handler = _TheChecksWarnings()
    loggers = [logging.getLogger(name) for name in _TheChecksWarnings.LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class _CtrlCStopsTraining:
    """While a flow runs here, Ctrl-C itself stops this process's training attempts, then
    interrupts the flow as usual (KeyboardInterrupt).

    The workers run in sessions of their own, out of Ctrl-C's reach. tasks.control's
    no_orphan_workers stops them only when the KeyboardInterrupt leaves the train flow's body,
    and in one full test suite run training went on after Ctrl-C with nothing stopping it.
    Started from the signal, the stop depends on no path the exception may take through
    Prefect's engine: the workers get CANCEL_GRACE_S for an emergency checkpoint and the
    attempt ends as cancelled (never retried). Until the flow is out, an attempt that the
    launch task starts after Ctrl-C (it was about to) is stopped as well.

    A second Ctrl-C (a double press is a habit) is told that the workers are still saving;
    interrupting the flow's unwinding again tore down the API while the stop still logged to
    it. A third leaves at once: the workers then stop by themselves (launch.orphan_timeout_s).
    With no training to stop (prepare, evaluate), every Ctrl-C interrupts. The command waits
    for the stop (`wait_for_stop`) before its server stops, and puts Ctrl-C back (`restore`).
    """

    POLL_S = 0.25

    def __init__(self):
        self.interrupted = 0  # Ctrl-C presses so far
        self.stops: list[threading.Thread] = []

    def __enter__(self) -> "_CtrlCStopsTraining":
        from infra.torchrun import attempts_running
        from tasks.control import CtrlC

        self.attempts_running = attempts_running  # imported now: not in the signal handler
        self.pressed = CtrlC  # its flow runs then end Cancelled (tasks.control.cancelled_on_ctrl_c)
        self.done = threading.Event()
        # A daemon: it never holds the process up. The stop threads it starts are not.
        self.watcher = threading.Thread(target=self._stop_training, name="ctrl-c-stops-training",
                                        daemon=True)
        self.watcher.start()
        self.previous = signal.signal(signal.SIGINT, self._on_ctrl_c)
        return self

    def _on_ctrl_c(self, signum, frame) -> None:
        # Runs in the main thread, between any two of its bytecodes: only a flag and a raw
        # write here, as taking a lock that the interrupted code holds would deadlock (print
        # included); the watcher stops the attempts.
        self.interrupted += 1
        self.pressed.pressed = True
        stopping = self.attempts_running() or any(thread.is_alive() for thread in self.stops)
        if self.interrupted == 1 or not stopping:  # nothing to wait for: interrupt again
            raise KeyboardInterrupt
        if self.interrupted == 2:
            os.write(2, b"goodput: stopping: the workers are saving an emergency checkpoint; "
                        b"Ctrl-C once more leaves without waiting\n")
            return
        os.write(2, b"goodput: leaving without waiting; the workers stop by themselves "
                    b"(launch.orphan_timeout_s)\n")
        os._exit(130)

    def _stop_training(self) -> None:
        from goodput.evaluation import stop_background_evaluations
        from infra.torchrun import stop_live_attempts
        from tasks.control import CANCEL_GRACE_S

        while not self.done.wait(self.POLL_S):
            if self.interrupted:
                self.stops += stop_live_attempts(grace_s=CANCEL_GRACE_S)  # each attempt once
                # The evaluations beside training run in sessions of their own, where the
                # terminal's SIGINT does not reach them: ended, not waited for.
                stop_background_evaluations()

    def __exit__(self, *exc_info) -> None:
        self.done.set()
        self.watcher.join()
        if not self.interrupted:
            self.restore()

    def wait_for_stop(self) -> None:
        """After Ctrl-C: until the attempts it stopped have ended (their emergency
        checkpoints written), Ctrl-C still answering as above."""
        from tasks.control import CANCEL_GRACE_S

        for thread in self.stops:
            thread.join(timeout=CANCEL_GRACE_S + 30)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self.previous)
        self.pressed.pressed = False  # for a later command in this process (main() in-process)


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID`: every thread's stack to the process's stderr (a command that seems
    stuck). faulthandler writes to a file descriptor: with none (stderr captured in memory,
    as when main() is called in-process), there is no dump."""
    if not hasattr(signal, "SIGUSR1") or sys.__stderr__ is None:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (OSError, ValueError):  # io.UnsupportedOperation: stderr has no file descriptor
        pass


def _prefect_defaults() -> None:
    """Prefect settings for this command's flows and its temporary server, where the
    environment sets none."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # How long the temporary server may take to answer (Prefect's setting for its own; 20 s by
    # default): a busy machine (2 cores, tests or a data preparation beside) took longer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Concurrency leases (a run's training slot) on disk, not in the server's memory: the
    # temporary server of a command that was killed would otherwise take its lease with it
    # and leave the slot taken for good (every later command of the run waiting on it).
    os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASES_ON_DISK)
    # The temporary server's SQLite file: a write waits up to a minute for the lock (10 s by
    # default), not failing with "database is locked" on a busy machine.
    os.environ.setdefault("PREFECT_API_DATABASE_TIMEOUT", "60")
    # The temporary server's task-run recorder commits every task-run event on its own by
    # default. On SQLite those commits met the API's writes: a request whose transaction had
    # read before one of them failed with "database is locked", the server answered 503 and
    # the client retried 2 s later (a subflow's start, a tagged task's slots). The failed
    # statement's cursor was left to the garbage collector, which, freeing it on the server's
    # event loop while its connection waited for the write lock, could freeze the server for
    # SQLite's 60 s busy timeout. Committed once a second, the recorder's writes rarely meet
    # the API's (benchmarks/RESULTS.md, "the 60 s stall found").
    os.environ.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "100")
    os.environ.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as build_parser() reads it, with key=value overrides anywhere on it
    (`show-config a.b=1 --config FILE c.d=2`: argparse alone takes only the first run of
    them), in the order given. A flag of torchrun's or Megatron's (`--nproc_per_node 2`,
    `--max-steps 5`) that names a config field is answered with the override to give."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    command = parser.commands[args.command]
    for token in extras:
        override = _override_for_flag(token, argv) if token.startswith("-") else None
        if override:
            command.error(f"{token.split('=')[0]} is not an option of goodput {args.command}: "
                          f"give the config field as an override: {override}")
    if not hasattr(args, "overrides") or any(token.startswith("-") for token in extras):
        if extras:
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return args
    # (One that is no key=value is refused by load_config, as in the first run, saying why.)
    args.overrides = [*args.overrides, *extras]  # after the first run of them
    return args


def _override_for_flag(flag: str, argv: list[str]) -> str | None:
    """`--nproc_per_node` (with `2` after it, or `=2`) -> 'parallelism.nproc_per_node=2': the
    config fields of that name (hyphens read as underscores), as overrides; None if none."""
    name, given, value = flag.lstrip("-").partition("=")
    fields = [f for f in config_fields() if f.rsplit(".", 1)[-1] == name.replace("-", "_")]
    if not fields:
        return None
    if not given:
        after = argv[argv.index(flag) + 1:][:1]
        value = (after[0] if after and "=" not in after[0]
                 and not (after[0].startswith("-") and not _is_number(after[0])) else "VALUE")
    return " or ".join(f"{field}={value}" for field in fields)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


FLOW_COMMANDS = ("prepare", "train", "evaluate", "pipeline")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _dump_stacks_on_sigusr1()
    _prefect_defaults()
    if args.command == "export":  # works on a checkpoint alone, no run configuration
        return _export(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "server":
        return _server(args)
    # A flow command's temporary server starts importing now (about 5 s of a core before it
    # answers), beside the config's checks and the nothing-to-do check: it stops at once
    # where it is not needed.
    server = temporary_server() if args.command in FLOW_COMMANDS else None
    try:
        config = load_config(args.config, args.overrides)
        if args.command in ("train", "pipeline"):
            from goodput.runs import check_run_config, warn_of_checkpoints_elsewhere

            check_run_config(config)  # a run this config would not continue: before anything starts
            with _the_checks_warnings():  # said once: the train flow's own warning is not repeated
                warn_of_checkpoints_elsewhere(config)
    except BaseException as e:
        if server is not None:
            server.stop()
        if not isinstance(e, ConfigError):
            raise
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        from core.config import dump_config

        print(dump_config(config), end="")
        return 0
    if args.command == "serve":
        from flows.deployments import serve_all

        try:
            serve_all(config, eval_cron=args.eval_cron, train_cron=args.train_cron,
                      train_time_limit_s=args.train_time_limit)
        except ConfigError as e:
            print(f"goodput: {e}", file=sys.stderr)
            return 2
        return 0

    ctrl_c = None
    try:
        unreachable = _store_out_of_reach(config)
        if unreachable:
            print(f"goodput: {unreachable}", file=sys.stderr)
            return 1
        result = _without_a_flow(args.command, config, getattr(args, "checkpoint", None))
        if result is not None:
            _say_result(args.command, config, result)
            return 0
        # Only the main thread may set a signal handler (main() may be called from another).
        ctrl_c = (_CtrlCStopsTraining() if threading.current_thread() is threading.main_thread()
                  else None)
        return _run_flow(args, config, server, ctrl_c)
    finally:
        try:
            if ctrl_c is not None and ctrl_c.interrupted:  # the stop logs to the server
                ctrl_c.wait_for_stop()
            if server is not None:
                if server.serving:  # also after Ctrl-C: what the client holds, sent while it runs
                    send_prefect_queues()
                server.stop()
        finally:
            if ctrl_c is not None and ctrl_c.interrupted:  # answered Ctrl-C until the server stopped
                ctrl_c.restore()


class _EachErrorOnceOnTheConsole(logging.Filter):
    """The terminal shows an error where it happened (the task run, or the flow run that
    raised it), not again as each flow run around it fails: a pipeline's DataError was
    printed 7 times, each 200 characters or more. The flow runs' own logs (the UI) keep
    theirs; task runs' lines all show (a retry's error may read as the last one did). Nor
    does it show again a warning that the command's check printed (_TheChecksWarnings)."""

    KEPT = 80  # characters of an error's text that identify it

    def __init__(self):
        super().__init__()
        self.shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return record.levelno < logging.WARNING or record.getMessage() not in _TheChecksWarnings.said
        message = record.getMessage()
        if record.name.startswith("prefect.flow_runs") and any(t in message for t in self.shown):
            return False
        error = record.exc_info[1] if record.exc_info else None
        # A state's message as Prefect writes it: repr(), so in '...' or, with a ' in it, "...".
        said = re.search(r"""Failed\((["'])\w[\w ]* exception:? \w+: (.*?)\1\)""", message)
        text = str(error) if error is not None else said.group(2) if said else ""
        if len(text) >= 12:  # a text that short could be part of any line
            self.shown.add(text[:self.KEPT])
            self.shown.add(repr(text)[1:self.KEPT + 1])  # as it reads inside a repr()
        return True


@contextmanager
def _each_error_once_on_the_console() -> Iterator[None]:
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    once = _EachErrorOnceOnTheConsole()
    for console in consoles:
        console.addFilter(once)
    try:
        yield
    finally:
        for console in consoles:
            console.removeFilter(once)


def _run_flow(args: argparse.Namespace, config: RunConfig, server: TemporaryServer | None,
              ctrl_c: _CtrlCStopsTraining | None) -> int:
    began = time.time()
    try:
        with flow_runs_recorded_by(server), _each_error_once_on_the_console():
            from flows.evaluate import evaluate
            from flows.pipeline import pipeline
            from flows.prepare import prepare
            from flows.train import train

            with ctrl_c or nullcontext():
                if args.command == "prepare":
                    result = _prepared(config, prepare(config))
                elif args.command == "train":
                    result = train(config)
                elif args.command == "evaluate":
                    result = evaluate(config, args.checkpoint).model_dump(exclude={"samples"})
                else:
                    result = pipeline(config)
    except KeyboardInterrupt:
        if ctrl_c is not None:
            ctrl_c.wait_for_stop()
        if args.command in ("train", "pipeline"):
            _secure_what_training_left(config, args.command)
        print(f"goodput: {args.command} interrupted", file=sys.stderr)
        _say_run_directory(config)
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
    except Exception as e:
        let_the_api_record(server, began)
        if type(e).__name__ == "CancelledRun":  # Prefect's (not imported here): the UI, the API, scancel
            print(f"goodput: {args.command} cancelled: {e}", file=sys.stderr)
            _say_run_directory(config)
            return 1
        print(f"goodput: {args.command} failed: {e}{_api_advice(e)}", file=sys.stderr)
        _say_run_directory(config)
        return 2 if _the_inputs_fault(e) else 1
    let_the_api_record(server, began)
    _say_result(args.command, config, result)
    return 0


def _say_result(command: str, config: RunConfig, result: dict) -> None:
    """A command's result on stdout, with or without a flow run: the JSON, the run directory,
    and after training the checkpoint to export."""
    print(json.dumps(result, indent=2, default=str))
    print(f"run directory: {config.run_dir.path.resolve()}")
    if command in ("train", "pipeline"):
        _say_how_to_export(config)


def _say_how_to_export(config: RunConfig) -> None:
    """After training: the newest good checkpoint (this machine's copy, else the store's),
    and the command that makes a transformers model of it. A new user found the run
    directory, DCP files in it, and had to search the README for the rest."""
    from core.uris import local_path_of
    from goodput.data.prepare import dataset_dir, dataset_store_prefix, mixture_dir
    from goodput.runs import read_summary
    from storage.ledger import Ledger, choose_resume
    from storage.manifests import CheckpointManifest
    from storage.store import store_uri

    try:
        ledger = Ledger(config.run_dir).read()
    except (OSError, ValueError):  # no ledger to read: nothing to name
        return
    point = choose_resume(config.run_dir, ledger)
    if point is None:
        return
    checkpoint = str(point.local.resolve()) if point.local else ledger.entries[point.step].store_url
    if not checkpoint:
        return
    # A model with no transformers form (an MoE routed otherwise than Mixtral or Qwen3-MoE):
    # the hint named an export that `goodput export` then refused.
    unexportable, overrides = _why_not_exportable(config)
    if unexportable:
        print(f"newest checkpoint: {checkpoint} (step {point.step}); not exportable as a Hugging "
              f"Face model: {'; '.join(unexportable)}. Trained with {' '.join(overrides)}, the "
              "same model would be (see README, Mixture of experts)")
        return
    # The dataset that trained it (its tokenizer and settings go with the model): named by
    # the checkpoint; by this run's prepare where only the store holds the checkpoint. After
    # `goodput train` alone, which records no prepare, the hint had no --tokenizer and the
    # export, without its tokenizer, wrote EOS as BOS and no pad.
    dataset = (CheckpointManifest.load(point.local).dataset_id if point.local
               else read_summary(config.run_dir).get("prepare", {}).get("dataset_id"))
    tokenizer = None
    if dataset:
        local = (mixture_dir if config.data.sources else dataset_dir)(config, dataset)
        if local.is_dir():
            tokenizer = str(local.resolve())
        elif not config.data.sources:
            # Trained from the store: no dataset directory here (its shard cache lacks a
            # Hugging Face tokenizer's side files); export fetches the tokenizer from the store.
            tokenizer = local_path_of(f"{store_uri(config.storage.uri)}/{dataset_store_prefix(dataset)}")
    given = f" --tokenizer {tokenizer}" if tokenizer else ""
    # export reads a store's URL with the endpoint AWS_ENDPOINT_URL names
    endpoint = (f"AWS_ENDPOINT_URL={config.storage.endpoint_url} "
                if "://" in checkpoint + given and config.storage.endpoint_url else "")
    print(f"newest checkpoint: {checkpoint} (step {point.step}); as a Hugging Face model: "
          f"{endpoint}goodput export {checkpoint} --format hf --out "
          f"{config.run_dir.path.resolve() / 'hf'}{given}")


def _why_not_exportable(config: RunConfig) -> tuple[list[str], list[str]]:
    """What keeps the run's model from a transformers form, and the overrides that would
    have trained it into one (training.model_args' hf_export_problems and
    hf_exportable_overrides, from the config: a routing bias is assumed where one is
    trained). ([], []) where it has one."""
    if config.model.moe is None and not config.model.qkv_bias:
        return [], []
    from training.model_args import hf_export_problems, hf_exportable_overrides, model_args_from_config

    args = model_args_from_config(config.model, config.model.vocab_size or 0)
    bias = "its expert_bias tensors" if config.model.moe and config.model.moe.bias_update_rate > 0 else None
    return hf_export_problems(args, bias), hf_exportable_overrides(args, bias)


def _secure_what_training_left(config: RunConfig, command: str) -> None:
    """After Ctrl-C stopped training: the checkpoints it committed that are not validated and
    uploaded yet (the workers' emergency checkpoint, at least) are judged and sent to the
    store before the command ends, as the train flow would have; before, they waited for the
    next run, and a machine given back after Ctrl-C took them with it. Ctrl-C again leaves
    them to the next run, which secures them first."""
    from goodput import checkpoint_lifecycle as lifecycle
    from storage.store import store_from_config

    if not config.run_dir.path.is_dir():
        return
    steps = lifecycle.unsecured_steps(config)
    if not steps:
        return
    print(f"goodput: securing checkpoint step(s) {', '.join(map(str, steps))} (validate, then "
          "upload to the store); Ctrl-C again leaves them to the next run", file=sys.stderr)
    left = list(steps)
    try:
        store = store_from_config(config.storage)
        for step in steps:
            entry = lifecycle.secure_checkpoint(config, step, store)
            left.remove(step)
            print(f"goodput: {lifecycle.secured_text(step, entry)}", file=sys.stderr)
        lifecycle.apply_retention(config, store)
    except KeyboardInterrupt:
        # Now, as a third Ctrl-C during training's stop does: an upload's transfer threads
        # would hold the process until they finished. The temporary server dies with it.
        os.write(2, f"goodput: checkpoint step(s) {', '.join(map(str, left))} left to the next "
                    f"run\ngoodput: {command} interrupted\n".encode())
        os._exit(130)
    except Exception as e:  # the store away, a verifier that crashed: the next run tries again
        print(f"goodput: checkpoint step(s) {', '.join(map(str, left))} not secured ({e}); the "
              "next run secures them", file=sys.stderr)


def _the_inputs_fault(error: Exception) -> bool:
    """Whether `error` is the input's, which its message says how to change (exit 2): a
    configuration or data error, raised as such or carried by a training attempt of class
    config (infra.torchrun.TrainingFailed), or credentials refused by the store or the
    Prefect server."""
    return (isinstance(error, (ConfigError, DataError, PermissionError))
            or getattr(error, "failure_class", None) == "config"
            or _refused_by_the_prefect_server(error))


def _refused_by_the_prefect_server(error: Exception) -> bool:
    """Whether `error` is the configured Prefect server (PREFECT_API_URL) answering 401 or
    403 (not another service's refusal, such as the Hugging Face Hub's for a gated dataset)."""
    if getattr(getattr(error, "response", None), "status_code", None) not in (401, 403):
        return False
    try:
        request = error.request  # httpx's HTTPStatusError has it
    except (AttributeError, RuntimeError):
        return False
    from prefect.settings import PREFECT_API_URL  # the settings' (a profile's too)

    api_url = PREFECT_API_URL.value() or ""
    return bool(api_url) and str(request.url).startswith(api_url.rstrip("/"))


def _api_advice(error: Exception) -> str:
    """What to do when the Prefect server configured (PREFECT_API_URL) refused this client
    or could not be reached; "" for other errors."""
    text = str(error)
    if _refused_by_the_prefect_server(error):
        return ("\n  the Prefect server refused this client: give it the server's auth string, "
                "PREFECT_API_AUTH_STRING (a `goodput server`'s: export PREFECT_API_AUTH_STRING="
                "\"$(cat .goodput/server/api-auth-string)\"), or PREFECT_API_KEY for Prefect Cloud")
    if "Failed to reach API at" in text:
        return ("\n  is the Prefect server up? (`goodput server`, `prefect server start`); or "
                "unset PREFECT_API_URL to run on a temporary server of this command's own")
    return ""


def _say_run_directory(config: RunConfig) -> None:
    """Where the run's files are, once there are any (a command that failed early made none)."""
    if config.run_dir.path.is_dir():
        print(f"run directory: {config.run_dir.path.resolve()}")


def run() -> None:
    """The `goodput` command: main(), then an exit without Python's own teardown, which took
    1.5 s after a command with torch and Prefect loaded (core.process_exit)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
