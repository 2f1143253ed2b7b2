"""The expert-parallel exchange against the expert GEMMs, per MoE layer and training step
(docs/scale-out.md): a model, not a measurement.

Per GPU with T tokens, k experts a token, hidden H, expert width F and uniform routing over P
ranks, a token's k rows leave the rank with probability (P - 1) / P; dispatch and combine in the
forward pass and their transposes in the backward move 4 * T * k * H * bytes_per_element * (P-1)/P
bytes. The SwiGLU experts take 3 GEMMs of 2 * H * F FLOPs per row forward and twice that
backward: 18 * T * k * H * F. T, k and H cancel in the ratio

    exchange time / expert GEMM time = 4 * bytes * rate * (P - 1) / P / (18 * F * bandwidth)

where `rate` is what nodrop's grouped GEMM sustains at that shape (measured, forward+backward).

    python3 bench/ep_cost_model.py
"""

# (name, expert width F, nodrop forward+backward TFLOP/s at its grouped-GEMM shape on an H200:
# bench/results/2026-12-01-h200-architecture-round/round/gpu-moe.md, uniform routing).
MODELS = (("Mixtral 8x7B", 14336, 671.0), ("DeepSeek-V3", 2048, 504.8),
          ("Qwen3-30B-A3B, the qwen3 preset", 768, 570.7))
NVLINK = 450e9  # bytes/s per direction per GPU, H100/H200 NVLink 4
INFINIBAND = 50e9  # one 400 Gb/s NIC per GPU
GPUS_PER_NODE = 8
BYTES = 2  # bfloat16 rows


def ratio(width: int, tflops: float, ranks: int) -> float:
    """Exchange over expert GEMM time at EP degree `ranks`, nodes of GPUS_PER_NODE GPUs: the
    rows for the other GPUs of the node cross NVLink, the rest InfiniBand, one after the other
    (no overlap)."""
    bytes_per_gemm_second = 4 * BYTES * tflops * 1e12 / (18 * width)
    in_node = (min(ranks, GPUS_PER_NODE) - 1) / ranks
    off_node = max(ranks - GPUS_PER_NODE, 0) / ranks
    return bytes_per_gemm_second * (in_node / NVLINK + off_node / INFINIBAND)


def main() -> None:
    degrees = (2, 4, 8, 16, 32, 64)
    print("| model (expert width) | " + " | ".join(f"EP {p}" for p in degrees) + " |")
    print("| --- | " + " | ".join("---:" for _ in degrees) + " |")
    for name, width, tflops in MODELS:
        cells = " | ".join(f"{ratio(width, tflops, p):.2f}" for p in degrees)
        print(f"| {name} ({width}) | {cells} |")


if __name__ == "__main__":
    main()
