"""The shapes every benchmark runs at, and the group sizes they split rows into.

One definition for bench/*.py. bench/cuda/grouped_matmul_bench.cu, in C++, keeps its own copy
of the GPU shapes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import numpy as np

from nodrop.moe import MoEConfig

# One grouped matmul: name -> (rows M, K, N, groups G).
CPU_GEMM_SHAPE = (4096, 512, 512, 8)  # bench/cpu_grouped_matmul.py
GEMM_SHAPES = {  # bench/gpu_*.py
    "Mixtral-8x7B": (16384, 4096, 14336, 8),
    "Qwen3-30B-A3B": (131072, 2048, 768, 128),
    "DeepSeek-V2-Lite": (98304, 2048, 1408, 64),
    "DeepSeek-V3-EP8": (8192, 7168, 2048, 32),  # one rank of 8-way expert parallelism
}
# DeepGEMM's grouped (contiguous layout) FP8 shapes, 4 equal groups of 8192 rows: issue 18's
# FP8 throughput target (bench/gpu_fp8.py; bench/cuda/fp8_blockwise_bench.cu keeps a copy).
DEEPGEMM_SHAPES = {
    "DeepGEMM-N4096-K7168": (32768, 7168, 4096, 4),
    "DeepGEMM-N7168-K2048": (32768, 2048, 7168, 4),
}

# One MoE layer (nodrop.moe.MoEBlock): name -> (tokens T, hidden H, expert FFN F, experts E,
# experts per token k).
LAYER_SHAPES = {
    "Mixtral-8x7B": (8192, 4096, 14336, 8, 2),
    "Qwen3-30B-A3B": (16384, 2048, 768, 128, 8),
    "DeepSeek-V2-Lite": (16384, 2048, 1408, 64, 6),
}
LAYER_SEED = 2  # of the layer's weights (nnx.Rngs) and data (nodrop.demo.inputs)

GROUP_SIZE_KINDS = ("uniform", "zipf")


def group_sizes(kind: str, rows: int, groups: int) -> np.ndarray:
    """[groups] int32 summing to rows: equal ("uniform"), or Zipf(1) ("zipf": group g gets a
    share 1/(g+1)); the rows left by rounding down go to group 0."""
    if kind not in GROUP_SIZE_KINDS:
        raise ValueError(f"group sizes {kind!r}: expected one of {GROUP_SIZE_KINDS}")
    share = np.ones(groups) if kind == "uniform" else 1.0 / np.arange(1, groups + 1)
    sizes = np.floor(rows * share / share.sum()).astype(np.int32)
    sizes[0] += rows - sizes.sum()
    return sizes


def layer_config(name: str, **fields):
    """The nodrop.moe.MoEConfig of LAYER_SHAPES[name] in bfloat16 (weights too), with `fields`
    on top (capacity_factor=1.0, say)."""
    _, hidden, ffn, experts, k = LAYER_SHAPES[name]
    return MoEConfig(num_experts=experts, k=k, hidden=hidden, ffn=ffn, dtype="bfloat16",
                     param_dtype="bfloat16", **fields)


def shape_list(names: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type for --shapes: a comma list of the given shape names, in any case, as
    they are spelled there."""
    known = {name.lower(): name for name in names}

    def parse(text: str) -> list[str]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [part for part in parts if part.lower() not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown shape {', '.join(unknown)}; known: {', '.join(known.values())}")
        return [known[part.lower()] for part in parts]

    return parse
