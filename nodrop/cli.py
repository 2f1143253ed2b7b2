"""The nodrop command line: `nodrop train`, `nodrop compare`, `nodrop demo`, `nodrop info`.

The benchmarks are programs of their own, in bench/ (bench/README.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import jax

import nodrop
from nodrop import _ffi, demo


EXIT_WRITE_FAILED = 74  # sysexits.h's EX_IOERR


def info(args: argparse.Namespace) -> int:
    print(f"nodrop {nodrop.__version__}")
    print(f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
          f"devices: {', '.join(str(device) for device in jax.devices())}")
    print("backends: " + ", ".join(f"{name} {'yes' if built else 'no'}"
                                   for name, built in nodrop.backends().items()))
    print("XLA FFI targets (handler symbols for cpu / CUDA):")
    for target in _ffi.TARGETS:
        print(f"  {target:32s} {_ffi.CPU_TARGETS[target]} / {_ffi.CUDA_TARGETS[target]}")
    return 0


def _training(command: str, body) -> int:
    """Runs a training command; unusable input is reported as `nodrop COMMAND: error: ...` with
    exit status 2 (no traceback), a diverged run with 1, a failed write (a full disk, lost
    permissions) with 74 (sysexits' EX_IOERR), SIGINT (Ctrl-C) with 130 and SIGTERM with 143
    (128 + the signal's number, the shells' convention)."""
    # Imported here: `nodrop info` and `nodrop demo` need none of Orbax, TensorBoard, matplotlib.
    from nodrop.train.checkpoint import CheckpointError
    from nodrop.train.config import ConfigError
    from nodrop.train.data import DataError
    from nodrop.train.lock import RunFolderError
    from nodrop.train.trainer import Diverged, Interrupted, WriteFailed

    try:
        return body()
    except (ConfigError, DataError, CheckpointError, RunFolderError) as error:
        print(f"nodrop {command}: error: {error}", file=sys.stderr)
        return 2
    except Diverged as error:
        print(f"nodrop {command}: error: {error}", file=sys.stderr)
        return 1
    except WriteFailed as error:
        print(f"nodrop {command}: error: {error}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except OSError as error:  # compare's own files (a run's are WriteFailed)
        print(f"nodrop {command}: error: {error}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except Interrupted as error:
        print(f"nodrop {command}: {error}", file=sys.stderr)
        return 128 + error.signum


def train(args: argparse.Namespace) -> int:
    def body():
        from nodrop.train import config, trainer
        summary = trainer.run(config.overrides_from_args(args), out=getattr(args, "out", None),
                              resume=getattr(args, "resume", False),
                              resume_from=getattr(args, "resume_from", None),
                              progress=False if getattr(args, "no_progress", False) else None)
        print(trainer.format_summary(summary))
        return 0

    return _training("train", body)


def compare(args: argparse.Namespace) -> int:
    def body():
        from nodrop.train import compare as comparison, config, trainer
        out = getattr(args, "out", None) or trainer.default_run_dir(
            f"compare-{getattr(args, 'preset', config.TrainConfig.preset)}")
        overrides = config.overrides_from_args(args)
        if args.seeds is not None and "seed" in overrides:
            raise config.ConfigError("give --seed or --seeds, not both")
        comparison.run(overrides, out, capacity_factors=args.capacity_factors,
                       with_ragged_dot=args.with_ragged_dot, seeds=args.seeds,
                       progress=False if getattr(args, "no_progress", False) else None)
        print(f"nodrop compare: wrote {out}/compare.md, compare.png, compare.json")
        print((Path(out) / "compare.md").read_text())
        return 0

    return _training("compare", body)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodrop", description=nodrop.__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from nodrop.train import config as train_config
    train_parser = commands.add_parser(
        "train", help="train an MoE language model (default: the tiny preset on this "
                      "Python's standard library, on the CPU)",
        description="Train an MoE language model: AdamW with warm-up and cosine decay, "
                    "evaluation, Orbax checkpoints, metrics.jsonl, TensorBoard, plots.")
    train_config.add_arguments(train_parser)
    train_parser.set_defaults(run=train)
    compare_parser = commands.add_parser(
        "compare", help="train the same model dropless and with capacity factors; table + plot",
        description="Train one model and seed dropless and with token-dropping capacity "
                    "factors (and optionally jax.lax.ragged_dot); write compare.md and "
                    "compare.png into --out.")
    train_config.add_arguments(compare_parser, resume=False)
    compare_parser.add_argument("--capacity-factors", type=float, nargs="+",
                                default=[1.0, 1.25], metavar="CF",
                                help="capacity factors to compare with (default 1.0 1.25)")
    compare_parser.add_argument("--seeds", type=int, nargs="+", metavar="N",
                                help="train every variant with each of these seeds and report "
                                     "the spread (default: --seed)")
    compare_parser.add_argument("--with-ragged-dot", action="store_true",
                                help="also train dropless on jax.lax.ragged_dot")
    compare_parser.set_defaults(run=compare)
    demo_parser = commands.add_parser(
        "demo", help="MoE layer forward+backward: check against the references, time it")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run, parser=demo_parser)
    commands.add_parser("info", help="versions, FFI targets and backends").set_defaults(run=info)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and args.topk > args.experts:
        args.parser.error(f"--topk ({args.topk}) must be at most --experts ({args.experts})")
    return args.run(args)
