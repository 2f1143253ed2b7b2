"""The nodrop command line: `nodrop train`, `nodrop compare`, `nodrop export`, `nodrop generate`,
`nodrop eval`, `nodrop demo`, `nodrop info`.

The benchmarks are programs of their own, in bench/ (bench/README.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import jax

import nodrop
from nodrop import _deps, _ffi, _gpu, demo
from nodrop.moe.block import DEFAULT_FP8_WEIGHT_GRADIENT
from nodrop.ops.fp8 import RECIPES as FP8_RECIPES
from nodrop.ops.fp8 import WEIGHT_GRADIENTS as FP8_WEIGHT_GRADIENTS
from nodrop.parallel import distributed


EXIT_WRITE_FAILED = 74  # sysexits.h's EX_IOERR


def _cuda_plugin() -> str | None:
    """The installed JAX CUDA plugin and its version, if any."""
    for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def info(args: argparse.Namespace) -> int:
    jaxlib = importlib.metadata.version("jaxlib")
    plugin = _cuda_plugin()
    print(f"nodrop {nodrop.__version__}")
    print(f"jax {jax.__version__}, jaxlib {jaxlib}, CUDA plugin: {plugin or 'none'}")
    print(f"devices: {', '.join(str(device) for device in jax.devices())} "
          f"(JAX runs on {jax.default_backend()})")
    usable = nodrop.backends()
    why_not = {}
    for name, built in _ffi.engines_built().items():
        if not built:
            why_not[name] = "not built" + (": the build found no nvcc or no CUTLASS"
                                           if name == "cuda" else "")
        elif not usable[name]:
            why_not[name] = (f"built, but JAX has no {name.upper()} device"
                             + ("" if plugin or name != "cuda" else ": no CUDA plugin"))
    print("backends: " + ", ".join(f"{name} {'yes' if ok else 'no (' + why_not[name] + ')'}"
                                   for name, ok in usable.items()))
    if not _ffi.jax_has("cuda"):
        try:
            choice = _gpu.choose()
        except ValueError as error:
            print(f"GPU: {error}")
        else:
            if choice.cuda:  # a GPU JAX is not using
                fix = ("its CUDA plugin found no usable GPU (see the warning above)" if plugin
                       else "install its CUDA plugin: pip install "
                       + " ".join(f"'{r}'" for r in _gpu.cuda_plugin(jaxlib)))
                print(f"GPU: {choice.reason}; JAX does not use it: {fix}")
    print("XLA FFI targets (handler symbols for cpu / CUDA):")
    for target in _ffi.TARGETS:
        print(f"  {target:32s} {_ffi.CPU_TARGETS[target]} / {_ffi.CUDA_TARGETS[target]}")
    return 0


def _training(command: str, body) -> int:
    """Runs a training command; unusable input is reported as `nodrop COMMAND: error: ...` with
    exit status 2 (no traceback), a diverged run with 1, a failed write (a full disk, lost
    permissions) with 74 (sysexits' EX_IOERR), SIGINT (Ctrl-C) with 130 and SIGTERM with 143
    (128 + the signal's number, the shells' convention)."""
    missing = _deps.missing_train_packages()
    if missing:  # before importing the trainer, which would fail on the first of them
        print(f"nodrop {command}: error: needs the trainer's packages, which are not installed "
              f"({', '.join(missing)}): {_deps.INSTALL_TRAIN}", file=sys.stderr)
        return 2
    # Imported here: `nodrop info` and `nodrop demo` need none of Orbax, TensorBoard, matplotlib.
    from nodrop.serve import LoadError
    from nodrop.train.checkpoint import CheckpointError
    from nodrop.train.config import ConfigError
    from nodrop.train.data import DataError
    from nodrop.train.lock import RunFolderError
    from nodrop.train.trainer import Diverged, Interrupted, WriteFailed

    try:
        return body()
    except (ConfigError, DataError, CheckpointError, RunFolderError, LoadError) as error:
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
        distributed.initialize_from_args(args)  # several processes: join them, else nothing
        summary = trainer.run(config.overrides_from_args(args), out=getattr(args, "out", None),
                              resume=getattr(args, "resume", False),
                              resume_from=getattr(args, "resume_from", None),
                              progress=False if getattr(args, "no_progress", False) else None)
        if distributed.is_primary():  # of several processes, 0 reports
            print(trainer.format_summary(summary))
        return 0

    return _training("train", body)


def compare(args: argparse.Namespace) -> int:
    def body():
        from nodrop.train import compare as comparison, config, trainer
        out = getattr(args, "out", None) or trainer.default_run_dir(
            f"compare-{getattr(args, 'preset', config.TrainConfig.preset)}")
        overrides = config.overrides_from_args(args)
        if args.seeds is not None and "seed" in vars(args):  # a --config file's seed yields
            raise config.ConfigError("give --seed or --seeds, not both")
        comparison.run(overrides, out, capacity_factors=args.capacity_factors,
                       with_ragged_dot=args.with_ragged_dot, fp8_recipes=args.fp8_recipes,
                       fp8_weight_gradients=args.fp8_weight_gradients,
                       seeds=args.seeds,
                       progress=False if getattr(args, "no_progress", False) else None)
        print(f"nodrop compare: wrote {out}/compare.md, compare.png, compare.json")
        print((Path(out) / "compare.md").read_text())
        return 0

    return _training("compare", body)


def export(args: argparse.Namespace) -> int:
    def body():
        from nodrop import serve
        weights = serve.export(args.run_dir, args.out, step=args.step)
        files = ", ".join(f"{f.name} ({f.stat().st_size:,} bytes)"
                          for f in sorted(weights.parent.iterdir()))
        print(f"nodrop export: wrote {weights.parent}: {files}")
        return 0

    return _training("export", body)


def generate(args: argparse.Namespace) -> int:
    def body():
        from nodrop import serve
        from nodrop.serve.generate import check_sampling, generate as sample
        from nodrop.train.config import ConfigError

        def flag_error(error: ValueError) -> ConfigError:  # "top_k must ..." -> "--top-k must ..."
            name, rest = str(error).split(" ", 1)
            return ConfigError(f"--{name.replace('_', '-')} {rest}")

        settings = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p)
        try:  # before the model loads
            check_sampling(**settings)
        except ValueError as error:
            raise flag_error(error) from None
        loaded = serve.load(args.run_dir, step=args.step, tokenizer=args.tokenizer)
        try:
            tokens = sample(loaded, loaded.encode(args.prompt), seed=args.seed, **settings)
        except ValueError as error:
            raise flag_error(error) from None
        print(args.prompt + loaded.decode(tokens))
        if len(tokens) < args.max_tokens:
            print(f"nodrop generate: stopped after {len(tokens)} tokens at the model's seq_len="
                  f"{loaded.config.seq_len}", file=sys.stderr)
        return 0

    return _training("generate", body)


def evaluate(args: argparse.Namespace) -> int:
    def body():
        import dataclasses
        import json
        import math

        from nodrop import serve
        from nodrop.serve.generate import evaluate as loss_of
        from nodrop.train import data, trainer
        loaded = serve.load(args.run_dir, step=args.step)
        config, _ = trainer.run_config(args.run_dir)  # an export keeps the run's config.json
        if args.data is not None:
            config = dataclasses.replace(config, data=args.data)
        dataset, *_ = trainer.load_data(config, loaded.config, echo=lambda _: None,
                                        run_dir=Path(args.run_dir))
        seq_len = config.seq_len
        data.check_length(dataset, seq_len)
        batches = data.eval_batches(dataset.val, args.batches or config.eval_batches,
                                    config.batch_size, seq_len)
        loss = loss_of(loaded, batches)
        result = {"run": str(Path(args.run_dir).absolute()), "step": loaded.step,
                  "data": str(config.data), "split": "validation", "tokens": sum(
                      b[:, 1:].size for b in batches), "loss": loss,
                  "perplexity": math.exp(loss)}
        print(json.dumps(result) if args.json else
              f"step {loaded.step}: validation loss {loss:.4f}, perplexity "
              f"{result['perplexity']:.2f} over {result['tokens']:,} tokens of {config.data}")
        return 0

    return _training("eval", body)


def _add_use_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", dest="run_dir",
                        help="a run folder (nodrop train --out) or an export (nodrop export)")
    parser.add_argument("--step", type=int, metavar="N",
                        help="the checkpoint of step N (default: the newest)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodrop", description=nodrop.__doc__)
    parser.add_argument("--version", action="version",
                        version=f"nodrop {nodrop.__version__} (jax {jax.__version__}, jaxlib "
                                f"{importlib.metadata.version('jaxlib')})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from nodrop.train import config as train_config
    train_parser = commands.add_parser(
        "train", help="train an MoE language model (default: the tiny preset on this "
                      "Python's standard library, on the CPU)",
        description="Train an MoE language model: AdamW with warm-up and cosine decay, "
                    "evaluation, Orbax checkpoints, metrics.jsonl, TensorBoard, plots.")
    train_config.add_arguments(train_parser)
    distributed.add_arguments(train_parser)
    train_parser.set_defaults(run=train)
    compare_parser = commands.add_parser(
        "compare", help="train the same model dropless and with capacity factors; table + plot",
        description="Train one model and seed dropless and with token-dropping capacity "
                    "factors (and optionally jax.lax.ragged_dot, or dropless on FP8 recipes); "
                    "write compare.md and compare.png into --out.")
    train_config.add_arguments(compare_parser, resume=False)
    compare_parser.add_argument("--capacity-factors", type=float, nargs="*",
                                default=[1.0, 1.25], metavar="CF",
                                help="capacity factors to compare with (default 1.0 1.25; the "
                                     "flag alone: none)")
    compare_parser.add_argument("--seeds", type=int, nargs="+", metavar="N",
                                help="train every variant with each of these seeds and report "
                                     "the spread (default: --seed)")
    compare_parser.add_argument("--with-ragged-dot", action="store_true",
                                help="also train dropless on jax.lax.ragged_dot")
    compare_parser.add_argument("--fp8-recipes", nargs="+", choices=FP8_RECIPES, default=(),
                                metavar="RECIPE",
                                help="also train dropless with the experts' matmuls on each of "
                                     f"these FP8 recipes ({', '.join(FP8_RECIPES)}), the same "
                                     "batches and initial weights as the bf16 run")
    compare_parser.add_argument("--fp8-weight-gradients", nargs="+",
                                choices=FP8_WEIGHT_GRADIENTS,
                                default=(DEFAULT_FP8_WEIGHT_GRADIENT,), metavar="WGRAD",
                                help="train each --fp8-recipes recipe once per weight gradient "
                                     f"listed ({', '.join(FP8_WEIGHT_GRADIENTS)}; default "
                                     f"{DEFAULT_FP8_WEIGHT_GRADIENT})")
    compare_parser.set_defaults(run=compare)
    export_parser = commands.add_parser(
        "export", help="a run's trained weights as safetensors, with config.json and tokenizer",
        description="Write a run's params (no optimizer state) as model.safetensors, with its "
                    "config.json and tokenizer.json, into --out; nodrop.load() reads it.")
    _add_use_arguments(export_parser)
    export_parser.add_argument("--out", required=True, metavar="EXPORT_DIR",
                               help="a new or empty folder")
    export_parser.set_defaults(run=export)
    generate_parser = commands.add_parser(
        "generate", help="sample text from a trained model (KV cache; greedy at temperature 0)")
    _add_use_arguments(generate_parser)
    generate_parser.add_argument("--prompt", required=True, metavar="TEXT")
    generate_parser.add_argument(
        "--tokenizer", metavar="FILE",
        help="a Hugging Face tokenizer.json to read the prompt and write the text with (a model "
             "trained on token ids needs the one its ids come from; default: the run's own)")
    generate_parser.add_argument("--max-tokens", type=int, default=100, metavar="N")
    generate_parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                                 help="0: greedy (default 1)")
    generate_parser.add_argument("--top-k", type=int, metavar="K")
    generate_parser.add_argument("--top-p", type=float, metavar="P")
    generate_parser.add_argument("--seed", type=int, default=0, metavar="S")
    generate_parser.set_defaults(run=generate)
    eval_parser = commands.add_parser(
        "eval", help="validation loss and perplexity of a trained model")
    _add_use_arguments(eval_parser)
    eval_parser.add_argument("--data", metavar="PATH",
                             help="data as nodrop train --data takes it; its validation split "
                                  "(default: the run's own)")
    eval_parser.add_argument("--batches", type=int, metavar="N",
                             help="batches of the run's batch size (default: its eval_batches)")
    eval_parser.add_argument("--json", action="store_true", help="print one JSON object")
    eval_parser.set_defaults(run=evaluate)
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
