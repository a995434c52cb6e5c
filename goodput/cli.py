"""`goodput`: run the stages locally (no Prefect server needed), or serve them as deployments.

    goodput pipeline                          # the whole thing on the built-in tiny default
    goodput prepare|train|evaluate|pipeline --config configs/tiny.yaml training.max_steps=50
    goodput evaluate --checkpoint 100         # a given step (or a checkpoint directory)
    goodput serve                             # deployments for the Prefect UI and schedules
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from goodput.config import ConfigError, load_config


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="RunConfig YAML (default: the built-in tiny config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="field overrides, e.g. training.max_steps=50 storage.uri=s3://b/p")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [("prepare", "tokenize and shard the dataset, publish it to the store"),
                            ("train", "train with torchrun, validating and uploading checkpoints"),
                            ("evaluate", "held-out loss, perplexity and samples of a checkpoint"),
                            ("pipeline", "prepare, train and evaluate")]:
        p = sub.add_parser(name, help=help_text)
        _config_args(p)
        if name == "evaluate":
            p.add_argument("--checkpoint", help="step number or checkpoint directory "
                                                "(default: the newest validated)")
    p = sub.add_parser("serve", help="serve the flows as deployments (Prefect UI, schedules)")
    _config_args(p)
    p.add_argument("--eval-cron", help="cron schedule for evaluating the newest checkpoint")
    p = sub.add_parser("show-config", help="print the resolved configuration")
    _config_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        from goodput.config import dump_config

        print(dump_config(config), end="")
        return 0
    if args.command == "serve":
        from flows.deployments import serve_all

        serve_all(config, eval_cron=args.eval_cron)
        return 0

    from flows.evaluate import evaluate
    from flows.pipeline import pipeline
    from flows.prepare import prepare
    from flows.train import train

    try:
        if args.command == "prepare":
            result = prepare(config).model_dump(include={"dataset_id", "vocab_size"})
        elif args.command == "train":
            result = train(config)
        elif args.command == "evaluate":
            result = evaluate(config, args.checkpoint).model_dump(exclude={"samples"})
        else:
            result = pipeline(config)
    except ConfigError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"goodput: {args.command} failed: {e}", file=sys.stderr)
        print(f"run directory: {config.run_dir.resolve()}")
        return 1
    print(json.dumps(result, indent=2, default=str))
    print(f"run directory: {config.run_dir.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
