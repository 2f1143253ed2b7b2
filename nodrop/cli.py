"""The nodrop command line: `nodrop demo`, `nodrop bench`, `nodrop info`."""

from __future__ import annotations

import argparse
import importlib.metadata

import jax

import nodrop
from nodrop import _ffi, bench, demo


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nodrop", description=nodrop.__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo", help="MoE layer forward+backward: check against the references, time it")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    bench_parser = commands.add_parser(
        "bench", help="CPU grouped-matmul benchmark against jax.lax.ragged_dot and jnp.dot")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run)
    commands.add_parser("info", help="versions, FFI targets and backends").set_defaults(run=info)

    args = parser.parse_args(argv)
    if args.command == "demo" and args.topk > args.experts:
        demo_parser.error(f"--topk ({args.topk}) must be at most --experts ({args.experts})")
    return args.run(args)
